"""The redis-py client for a ``DEFERRAL_REDIS_URL`` (what the URL names:
:mod:`deferral.runtime.redis_urls`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel

from deferral.runtime.redis_urls import parse


def raw_replies(client: Any, commands: Iterable[str]) -> None:
    """Remove redis-py's reply parsing of ``commands`` on ``client`` (broker/DECISIONS.md rule
    4). A cluster client parses each reply on the client of the node that answered, and makes
    those clients as it discovers nodes (a promoted replica too): each one gets the same."""
    if not isinstance(client, RedisCluster):
        for command in commands:
            client.response_callbacks.pop(command, None)
        return
    for node in client.get_nodes():
        if node.redis_connection is not None:
            raw_replies(node.redis_connection, commands)
    nodes = client.nodes_manager
    create = nodes.create_redis_node

    def create_raw(host: str, port: int, **kwargs: Any) -> redis.Redis:
        made = create(host, port, **kwargs)
        raw_replies(made, commands)
        return made

    nodes.create_redis_node = create_raw  # type: ignore[method-assign]


class _Cluster(RedisCluster):
    """A cluster client that finds XREADGROUP's slot in the command itself.

    redis-py asks its default node (``COMMAND GETKEYS``) where the keys of a command with
    movable keys are, and does so before its retry loop: once that node is gone (a killed
    primary), every read fails until the process restarts, while other commands recover. Read
    from the arguments, the slot costs no round trip and no node."""

    def determine_slot(self, *args: Any) -> int | None:
        if str(args[0]).upper() != "XREADGROUP":
            return super().determine_slot(*args)
        # XREADGROUP GROUP <group> <consumer> [COUNT n] [BLOCK ms] [NOACK] STREAMS <keys> <ids>
        start = next(i for i in range(4, len(args)) if str(args[i]).upper() == "STREAMS") + 1
        streams = args[start:]
        slots = {key_slot(self.encoder.encode(key)) for key in streams[: len(streams) // 2]}
        if len(slots) != 1:
            raise RedisClusterException(f"XREADGROUP over streams in {len(slots)} slots")
        return slots.pop()


def client(url: str, options: dict[str, Any], *, max_connections: int) -> Any:
    """The redis-py client for ``url`` (a ``redis.Redis`` or a ``RedisCluster``)."""
    where = parse(url)
    auth: dict[str, Any] = {"username": where.username, "password": where.password}
    if where.kind == "cluster":
        return _Cluster(
            startup_nodes=[ClusterNode(h, p) for h, p in where.hosts],
            max_connections=max_connections,
            ssl=where.tls,
            **auth,
            **options,
        )
    if where.kind == "sentinel":
        sentinel = Sentinel(list(where.hosts), socket_timeout=5.0)
        return sentinel.master_for(
            where.service,
            redis_class=redis.Redis,
            db=where.db,
            max_connections=max_connections,
            **auth,
            **options,
        )
    # A blocking pool: threads that find every connection busy wait for one instead of
    # failing with "Too many connections".
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, **options
    )
    return redis.Redis(connection_pool=pool)


def location(url: str) -> str:
    """Where ``url`` points, without credentials, for messages."""
    where = parse(url)
    if where.kind == "single":
        pool = redis.ConnectionPool.from_url(url)
        kwargs = pool.connection_kwargs
        if "path" in kwargs:
            return str(kwargs["path"])
        return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    hosts = ",".join(f"{h}:{p}" for h, p in where.hosts)
    return f"{where.kind} {hosts}" + (f" service {where.service}" if where.service else "")
