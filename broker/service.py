"""The service skeleton: what the scheduler, the worker and the triggerer each need to consume
streams as processes of their kind, written once (broker/DECISIONS.md rule 32).

- :func:`consumer_set`: a service's consumers, one per stream, sharing one :class:`Quarantine`
  and reading the liveness of their owners from the service's table.
- :func:`connect`: the start-up wait for Redis and PostgreSQL.
- :class:`Registration`: the process's row (name, host, pid, state and what the service adds),
  written at start, every heartbeat and on the way out; :func:`heartbeat` renews the leases,
  hands on what was lost and writes that row.
- :func:`read_each` and :func:`poisoned`: entries that cannot be read, or that killed every
  reader, are set aside with one line saying why.
- :func:`batch_then_each` and :func:`each_alone`: apply a batch together; if it fails on bad
  data, apply it again one item at a time, so that the bad one alone is refused.
- :func:`hand_off`: on the way out, what the process holds is made to look long idle, so peers
  take it at once instead of after the takeover delay.
- :func:`serve`: the loop of the synchronous services (the triggerer's is anyio's).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from redis.exceptions import RedisError
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, connect_when_up
from broker.consumer import Delivery, Lost, Quarantine, StreamConsumer, run_until_stopped
from broker.consumers import ConsumerSet
from broker.owners import PostgresOwners
from broker.streams import ForgedEntry, MalformedEntry
from deferral.runtime import clock
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient
from deferral.runtime.outages import settle_over_heartbeats
from deferral.runtime.process import freeze_startup_objects
from deferral.store import liveness
from deferral.store.db import wait_until_up

log = logging.getLogger("deferral.service")

T = TypeVar("T")
R = TypeVar("R")


def consumer_set(
    broker: Broker,
    streams: Sequence[str],
    *,
    group: str,
    name: str,
    settings: Settings,
    cipher: Cipher,
    owners: PostgresOwners,
    starts_on_admit: bool = True,
) -> ConsumerSet:
    """The consumers of a service's ``streams`` (and of those it joins later) in ``group``,
    as process ``name``: one quarantine per process, over all its streams."""
    quarantine = Quarantine()

    def consumer_of(stream: str) -> StreamConsumer:
        return StreamConsumer(
            broker,
            stream,
            group,
            name,
            heartbeat_sec=settings.heartbeat_sec,
            max_deliveries=settings.max_deliveries,
            cipher=cipher,
            dead_letter_maxlen=settings.dead_letter_maxlen,
            owners=owners,
            quarantine=quarantine,
            starts_on_admit=starts_on_admit,
        )

    return ConsumerSet(consumer_of, streams)


def connect(settings: Settings, engine: Engine, stop: threading.Event) -> Broker | None:
    """Redis connected and PostgreSQL answering, waited for until ``stop`` is set (None then)."""
    broker = connect_when_up(
        settings.redis_url, settings.stream_prefix, stop, settings.stream_shards
    )
    if broker is None or not wait_until_up(engine, stop):
        return None
    return broker


class Registration:
    """A process's row in its kind's table, which ``deferral health``, the CLI and the consumers'
    owner checks read: its name, host and pid, its state, and what ``details`` adds (its load,
    capacity, queues)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        table: liveness.Process,
        name: str,
        details: Callable[[], Mapping[str, Any]] = dict,
    ) -> None:
        self.sessions = sessions
        self.table = table
        self.name = name
        self.details = details
        self.hostname = socket.gethostname()

    def record(
        self, state: str = liveness.RUNNING, sessions: sessionmaker[Session] | None = None
    ) -> None:
        """Write the row (through ``sessions``, else the service's), stamping its heartbeat,
        and measure this host's clock against the database's (time triggers fire by it)."""
        values = {
            "name": self.name,
            "hostname": self.hostname,
            "pid": os.getpid(),
            **self.details(),
            "state": state,
        }
        with (sessions or self.sessions).begin() as session:
            liveness.heartbeat(session, self.table, values)
            clock.observe(session)

    def record_stop(self) -> None:
        """Say the process stopped; if the servers fail, it only looks stale a while later."""
        try:
            self.record(liveness.STOPPED)
        except (RedisError, SQLAlchemyError) as exc:
            log.warning("could not record %s as stopped: %s", self.name, exc)


def heartbeat(
    consumer: ConsumerSet,
    registration: Registration,
    on_lost: Callable[[list[Lost]], None] | None = None,
) -> None:
    """Renew the leases on every entry held, hand the entries found lost to ``on_lost``, and
    record the process as alive: also when Redis fails (the error is raised after), or once it
    is back every live process would look dead, its entries idle for the whole outage taken
    over and its running attempts failed into retries."""
    try:
        lost = consumer.renew()
    finally:
        registration.record(liveness.RUNNING)
    if lost and on_lost is not None:
        on_lost(lost)


def hand_off(consumer: ConsumerSet, what: str) -> None:
    """On the way out (after the last renewal: one after it would make the entries look fresh),
    make every entry held look long idle so that live peers take it at once instead of after
    the takeover delay. If Redis fails, they take it after the delay."""
    try:
        handed = consumer.hand_off()
    except RedisError as exc:
        log.warning("could not hand off %s: %s (peers take them after the delay)", what, exc)
        return
    if handed:
        log.info("handed off %d %s", handed, what)


def read_each(
    deliveries: Sequence[Delivery], read: Callable[[Delivery], T], what: str
) -> tuple[list[tuple[Delivery, T]], list[tuple[Delivery, str]]]:
    """Each delivery with what ``read`` makes of it, and those it cannot read with why (to be
    dead-lettered): a malformed or forged ``what``, or one that raised something unforeseen --
    bad data sets aside its entry, never the loop."""
    read_ok: list[tuple[Delivery, T]] = []
    unreadable: list[tuple[Delivery, str]] = []
    for delivery in deliveries:
        try:
            read_ok.append((delivery, read(delivery)))
        except (MalformedEntry, ForgedEntry) as exc:
            unreadable.append((delivery, f"bad {what}: {exc}"))
        except Exception as exc:
            unreadable.append((delivery, f"unreadable {what}: {type(exc).__name__}: {exc}"))
    return read_ok, unreadable


def poisoned(consumer: ConsumerSet, delivery: Delivery, what: str) -> str | None:
    """Why ``delivery`` is set aside if it was delivered as often as allowed and every reader
    died with it (a poison: ``what`` it is, then how often), else None."""
    if not consumer.exhausted(delivery):
        return None
    return f"{what} {consumer.exhausted_reason(delivery)}"


def batch_then_each(
    items: Sequence[T],
    together: Callable[[Sequence[T]], R],
    alone: Callable[[Sequence[T]], R],
    *,
    doing: str,
    logger: logging.Logger,
) -> R:
    """``together(items)``, in one transaction; if it fails on bad data (a non-transient error:
    that transaction rolled back), ``alone(items)``, which applies them one by one so the bad one
    fails alone. A transient error is raised: the caller retries the whole batch."""
    try:
        return together(items)
    except Exception as exc:
        if is_transient(exc):
            raise
        logger.exception("%s together failed; one by one now", doing)
        return alone(items)


def each_alone(
    items: Sequence[T], apply: Callable[[T], R], refuse: Callable[[T, Exception], None]
) -> list[R]:
    """``apply`` each item on its own; one that fails on bad data is handed to ``refuse`` with
    its error and the others go on. A transient error is raised (nothing is refused for it)."""
    applied: list[R] = []
    for item in items:
        try:
            applied.append(apply(item))
        except Exception as exc:
            if is_transient(exc):
                raise
            refuse(item, exc)
    return applied


def serve(
    stop: threading.Event,
    settings: Settings,
    engine: Engine,
    *,
    attach: Callable[[Broker], object],
    begin: Callable[[], object],
    step: Callable[[], object],
    recover: Callable[[], object],
    started: Callable[[], None],
) -> bool:
    """A synchronous service's life up to its stop: wait for the servers, ``attach`` the
    broker, ``begin`` (retried until it succeeds), say it ``started``, then ``step`` until
    ``stop`` is set, calling ``recover`` after each failure (a lost group is made again).
    False if stopped before it began: then there is nothing to wind down."""
    broker = connect(settings, engine, stop)
    if broker is None:
        return False
    attach(broker)
    # Steps retried at least twice a heartbeat: each renews the leases when they are due.
    cap = settings.heartbeat_sec / 2
    settle_over_heartbeats(settings.heartbeat_sec)
    if not run_until_stopped(stop, begin, recover=recover, once=True, backoff_cap=cap):
        return False
    freeze_startup_objects()
    started()
    run_until_stopped(stop, step, recover=recover, backoff_cap=cap)
    return True
