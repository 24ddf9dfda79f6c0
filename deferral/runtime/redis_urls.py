"""Which Redis a ``DEFERRAL_REDIS_URL`` names (the settings check it; :mod:`broker.topology`
makes the client).

- ``redis://`` / ``rediss://`` / ``unix://``: one Redis (redis-py's URL rules);
- ``redis+cluster://host:port[,host:port...]``: a Redis Cluster, through redis-py's cluster
  client (the nodes listed are only where it starts looking; keys are hash-tagged, see
  :class:`broker.streams.StreamKeys`);
- ``redis+sentinel://host:port[,host:port...]/service_name[/db]``: the primary the Sentinels
  name for ``service_name``, found again after a failover (no TLS).

A password (``redis+sentinel://:secret@h:p/...``) is the data nodes' one, never sent in clear
in messages: ``broker.topology.location`` leaves credentials out.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
URL_STARTS = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+cluster://",
    "rediss+cluster://",
    "redis+sentinel://",
)
SENTINEL_SCHEMES = ("redis+sentinel",)
MAX_HOSTS = 64


class RedisUrlError(ValueError):
    """A Redis Cluster or Sentinel URL that cannot be understood (the message says why)."""


@dataclass(frozen=True)
class Topology:
    kind: str  # "single", "cluster" or "sentinel"
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse(url: str) -> Topology:
    """What ``url`` names; RedisUrlError naming the fault for a bad cluster or sentinel URL."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in (*CLUSTER_SCHEMES, *SENTINEL_SCHEMES):
        return Topology("single")
    kind = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    username = password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        user, has_password, secret = auth.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    netloc, _, path = rest.partition("/")
    hosts = tuple(_host(part, url_kind=kind) for part in netloc.split(",") if part)
    if not hosts:
        raise RedisUrlError(f"the Redis {kind} URL names no host:port")
    if len(hosts) > MAX_HOSTS:
        raise RedisUrlError(f"the Redis {kind} URL names more than {MAX_HOSTS} hosts")
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    service, db = "", 0
    if kind == "sentinel":
        if not parts:
            raise RedisUrlError("the Redis sentinel URL names no service: .../service_name")
        service = unquote(parts[0])
        parts = parts[1:]
    if parts:
        if kind == "cluster" or len(parts) > 1 or not parts[0].isdigit() or len(parts[0]) > 2:
            raise RedisUrlError(f"the Redis {kind} URL has an unexpected path {path[:60]!r}")
        db = int(parts[0])
    return Topology(kind, hosts, service, db, username, password, scheme.startswith("rediss"))


def _host(part: str, *, url_kind: str) -> tuple[str, int]:
    host, _, port = part.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisUrlError(f"the Redis {url_kind} URL has a bad host:port {part[:60]!r}")
    return host.strip("[]"), int(port)


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://host:port[,host:port...]``)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


# DEFERRAL_STREAM_SHARDS: how many logical shards the triggers and events streams are split into.
# One Redis gains nothing from more than one (and keeps the plain key names); a cluster spreads
# the shards over its primaries, so the default leaves room to grow to 16 of them.
CLUSTER_STREAM_SHARDS = 16
MAX_STREAM_SHARDS = 256


def default_stream_shards(url: str) -> int:
    """DEFERRAL_STREAM_SHARDS when it is not set: 16 on a Redis Cluster, else 1."""
    return CLUSTER_STREAM_SHARDS if is_cluster_url(url) else 1
