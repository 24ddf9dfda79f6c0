"""Asset watchers: the event triggers of ``AssetWatcher`` (rows of ``asset_watcher``, written by
the schedulers from the DAGs they parse), run by whichever triggerer holds each one's lease.

Every heartbeat a triggerer claims, in one statement, the watchers whose DAG is active (not
paused, its file loads) that are unheld, held by it, or whose lease ran out (2.1 heartbeats: a
triggerer killed with -9 loses them to its peers then), and renews its own. A watcher it runs
that it no longer holds (the DAG was paused, a peer took it) is cancelled. Each event of a
watcher is committed as an asset event (once per dedup key: a redelivered event, or one two
triggerers both saw during a takeover, makes one) before ``acknowledge`` tells the source."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from deferral.assets import event_from_trigger
from deferral.runtime.config import DEFAULT_ASSET_WATCHER_MAX_QUEUED
from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.runtime.faults import is_transient
from deferral.runtime.metrics import ASSET_WATCHER_BOUND_REACHED
from deferral.runtime.outages import OUTAGE
from deferral.runtime.serialization import SerializationError
from deferral.store.transitions.asset_events import record_watcher_event, watcher_events_waiting
from deferral.store.waits import resume_asset_waiters
from deferral.triggers.base import TriggerEvent
from deferral.triggers.event import BaseEventTrigger
from triggerer.decode import load_trigger_class

log = logging.getLogger("deferral.triggerer")

# A lease outlives two missed heartbeats (as the trigger entries' takeover threshold).
LEASE_HEARTBEATS = 2.1
# Watchers one triggerer holds at most.
MAX_WATCHERS = 1000
# Events recorded in one transaction at most.
EVENT_BATCH = 100
# A watcher held at its bound says so in the log at most this often.
BOUND_WARNING_EVERY_SEC = 60.0
# After a watcher's trigger fails, this many heartbeats pass before it runs again.
RESTART_HEARTBEATS = 1

_CLAIM_SQL = text(
    """
    UPDATE asset_watcher AS w
    SET triggerer_id = :me, lease_expires_at = now() + make_interval(secs => :lease)
    WHERE w.id IN (
        SELECT w2.id FROM asset_watcher AS w2 JOIN dag AS d ON d.dag_id = w2.dag_id
        WHERE d.is_active AND NOT d.is_paused AND d.missing_since IS NULL
            AND (w2.triggerer_id = :me OR w2.triggerer_id IS NULL OR w2.lease_expires_at < now())
        ORDER BY w2.triggerer_id = :me DESC NULLS LAST, w2.id
        LIMIT :limit
        FOR UPDATE OF w2 SKIP LOCKED
    )
    RETURNING w.id, w.asset_name, w.name, w.kwargs
    """
)

_RELEASE_SQL = text(
    "UPDATE asset_watcher SET triggerer_id = NULL, lease_expires_at = NULL WHERE triggerer_id = :me"
)


@dataclass(frozen=True)
class Claimed:
    id: int
    asset_name: str
    name: str
    token: str


def open_watcher(token: str, cipher: Cipher, prefixes: Sequence[str]) -> BaseEventTrigger:
    """The event trigger of a watcher row, from its authenticated token only; ValueError naming
    what is wrong (forged token, class outside DEFERRAL_TRIGGER_MODULES, not an event trigger)."""
    try:
        spec = cipher.open(Purpose.WATCHER_SPEC, token)
        classpath, kwargs = spec["classpath"], dict(spec["kwargs"])
    except (DecryptionError, SerializationError, KeyError, TypeError) as exc:
        raise ValueError(f"watcher token refused: {exc}") from None
    cls = load_trigger_class(classpath, prefixes)
    if not issubclass(cls, BaseEventTrigger):
        raise ValueError(f"{classpath} is not an event trigger (BaseEventTrigger)")
    return cls(**kwargs)


class WatcherRunner:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        cipher: Cipher,
        name: str,
        prefixes: Sequence[str],
        heartbeat_sec: float,
        max_queued: int = DEFAULT_ASSET_WATCHER_MAX_QUEUED,
    ) -> None:
        self.sessions = sessions
        self.cipher = cipher
        self.name = name
        self.prefixes = prefixes
        self.heartbeat_sec = heartbeat_sec
        # Events of one watcher that may wait for their runs (DEFERRAL_ASSET_WATCHER_MAX_QUEUED).
        self.max_queued = max_queued
        # watcher id -> (what its token holds, scope that cancels it)
        self.running: dict[int, tuple[Any, anyio.CancelScope]] = {}
        self.recorded = 0  # events recorded here (new ones), for tests and logs

    def _claim(self) -> list[Claimed]:
        with self.sessions.begin() as session:
            rows = session.execute(
                _CLAIM_SQL,
                {
                    "me": self.name,
                    "lease": self.heartbeat_sec * LEASE_HEARTBEATS,
                    "limit": MAX_WATCHERS,
                },
            ).all()
        return [Claimed(*row) for row in rows]

    def _release(self) -> None:
        with self.sessions.begin() as session:
            session.execute(_RELEASE_SQL, {"me": self.name})

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                while True:
                    try:
                        claimed = await anyio.to_thread.run_sync(self._claim)
                    except Exception as exc:  # a beat that fails is tried at the next one
                        if is_transient(exc):
                            OUTAGE.failed(exc, "claiming asset watchers")
                        else:
                            log.warning("claiming asset watchers failed: %s", exc)
                    else:
                        self._apply(tasks, claimed)
                    await anyio.sleep(self.heartbeat_sec)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(self._release)
                except Exception as exc:
                    log.warning("could not release the asset watchers: %s", exc)

    def _spec(self, token: str) -> Any:
        """What a token holds (sealed again at every parse, so tokens differ, specs not)."""
        try:
            return self.cipher.open(Purpose.WATCHER_SPEC, token)
        except (DecryptionError, SerializationError):
            return token

    def _apply(self, tasks: TaskGroup, claimed: list[Claimed]) -> None:
        wanted = {c.id: (c, self._spec(c.token)) for c in claimed}
        for watcher_id, (spec, scope) in list(self.running.items()):
            if watcher_id not in wanted or wanted[watcher_id][1] != spec:
                scope.cancel()
                del self.running[watcher_id]
        for c, spec in wanted.values():
            if c.id not in self.running:
                scope = anyio.CancelScope()
                self.running[c.id] = (spec, scope)
                tasks.start_soon(self._watch, c, scope)

    async def _watch(self, claimed: Claimed, scope: anyio.CancelScope) -> None:
        where = f"asset watcher {claimed.name!r} of asset {claimed.asset_name!r}"
        with scope:
            try:
                trigger = open_watcher(claimed.token, self.cipher, self.prefixes)
            except Exception as exc:
                log.error("%s cannot run: %s", where, exc)
                await anyio.sleep_forever()  # until its row changes or its DAG leaves
            log.info("%s started on triggerer %s", where, self.name)
            await self._watch_trigger(trigger, claimed, where)

    async def _watch_trigger(self, trigger: BaseEventTrigger, claimed: Claimed, where: str) -> None:
        """Run the watcher's trigger for ever, again a heartbeat after it ends or fails (its
        failure logged as what went wrong, not as the task group that carried it)."""
        while True:
            try:
                await self._events(trigger, claimed, where)
                log.warning("%s ended; running it again", where)
            except Exception as exc:
                log.error("%s failed: %s", where, cause_of(exc))
            finally:
                with anyio.CancelScope(shield=True):
                    await _quietly(trigger.cleanup)
            await anyio.sleep(self.heartbeat_sec * RESTART_HEARTBEATS)

    async def _events(self, trigger: BaseEventTrigger, claimed: Claimed, where: str) -> None:
        """Record the trigger's events as they come, those already waiting together in one
        transaction (at most EVENT_BATCH, and no more than the watcher's bound leaves room
        for), then acknowledge them in order. At the bound, the events read stay unrecorded
        and unacknowledged and the reader stops at its buffer, until runs start."""
        send, receive = anyio.create_memory_object_stream[TriggerEvent](EVENT_BATCH)
        at_bound = False
        warned_at: float | None = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._read, trigger, send, where)
            async with receive:
                held: list[TriggerEvent] = []
                while True:
                    if not held:
                        try:
                            held.append(await receive.receive())
                        except anyio.EndOfStream:
                            return
                    while len(held) < EVENT_BATCH:
                        try:
                            held.append(receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    keyed = _keyed(held, where)
                    record = partial(self._record, claimed, [(k, e) for _, k, e in keyed], where)
                    taken = await anyio.to_thread.run_sync(record, abandon_on_cancel=False)
                    if not keyed or taken:
                        at_bound = False
                    elif not at_bound:
                        at_bound = True
                        ASSET_WATCHER_BOUND_REACHED.inc()
                        # Each run that starts frees one place and the bound is reached again:
                        # the metric counts every time, the log says so once a minute at most.
                        now = time.monotonic()
                        if warned_at is None or now - warned_at >= BOUND_WARNING_EVERY_SEC:
                            warned_at = now
                            log.warning(
                                "%s: %d of its events wait for their runs"
                                " (DEFERRAL_ASSET_WATCHER_MAX_QUEUED): reading paused until runs"
                                " start",
                                where,
                                self.max_queued,
                            )
                    for event, _, _ in keyed[:taken]:
                        await trigger.acknowledge(event)
                    # Events left out by _keyed are never acknowledged (see there).
                    held = [event for event, _, _ in keyed[taken:]]
                    if held:
                        await anyio.sleep(self.heartbeat_sec)

    @staticmethod
    async def _read(
        trigger: BaseEventTrigger, send: MemoryObjectSendStream[TriggerEvent], where: str
    ) -> None:
        events: Any = trigger.run()
        async with send:
            async for event in events:
                if isinstance(event, TriggerEvent):
                    await send.send(event)
                else:
                    log.error("%s yielded %s, not a TriggerEvent: skipped", where, type(event))

    def _record(
        self, claimed: Claimed, events: list[tuple[str, dict[str, Any]]], where: str
    ) -> int:
        """Record the first of ``events`` the watcher's bound leaves room for, in one
        transaction; how many were taken. If that transaction fails for a reason of the data
        (not the servers), each event is recorded in a transaction of its own, and an event that
        still fails is recorded as a failure: an event with its key whose extra names the cause.
        """
        taken: list[tuple[str, dict[str, Any]]] | None = None
        try:
            with self.sessions.begin() as session:
                room = self.max_queued - watcher_events_waiting(
                    session, claimed.asset_name, claimed.name, self.max_queued
                )
                taken = events[: max(room, 0)]
                got = [self._record_one(session, claimed, key, extra) for key, extra in taken]
        except Exception as exc:
            if is_transient(exc) or taken is None:
                raise
            log.warning(
                "%s: a batch of %d events failed (%s); recording them one by one",
                where,
                len(taken),
                cause_of(exc),
            )
            got = [self._record_alone(claimed, key, extra, where) for key, extra in taken]
        self.recorded += sum(1 for event_id in got if event_id is not None)
        return len(taken)

    def _record_one(
        self, session: Session, claimed: Claimed, key: str, extra: dict[str, Any]
    ) -> int | None:
        """Record the event, and resume the tasks waiting on the asset in its transaction."""
        event_id = record_watcher_event(session, claimed.asset_name, claimed.name, key, extra)
        if event_id is not None:
            resume_asset_waiters(session, self.cipher, [event_id])
        return event_id

    def _record_alone(
        self, claimed: Claimed, key: str, extra: dict[str, Any], where: str
    ) -> int | None:
        try:
            with self.sessions.begin() as session:
                return self._record_one(session, claimed, key, extra)
        except Exception as exc:
            if is_transient(exc):
                raise
            cause = cause_of(exc)
        log.error(
            "%s: entry %s could not be recorded (%s): recorded as a failure", where, key, cause
        )
        failure = {"error": f"the entry could not be recorded: {cause}"}
        with self.sessions.begin() as session:
            return self._record_one(session, claimed, key, failure)


def cause_of(exc: BaseException) -> str:
    """What went wrong, in one line: the errors inside an exception group (not its wrapper), a
    database error's own first line (not the statement and its parameters)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(cause_of(inner) for inner in exc.exceptions)
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _keyed(batch: list[TriggerEvent], where: str) -> list[tuple[TriggerEvent, str, dict[str, Any]]]:
    """The events of a batch with their dedup key and extra; one without a valid key is logged
    and left out (never acknowledged: its source may deliver it again)."""
    keyed: list[tuple[TriggerEvent, str, dict[str, Any]]] = []
    for event in batch:
        try:
            key, extra = event_from_trigger(event)
        except ValueError as exc:
            log.error("%s: event skipped: %s", where, exc)
            continue
        keyed.append((event, key, extra))
    return keyed


async def _quietly(func: Any) -> None:
    try:
        await func()
    except Exception as exc:
        log.warning("asset watcher cleanup raised %s: %s", type(exc).__name__, exc)
