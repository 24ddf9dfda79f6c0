"""Dead letters, the operator's side: read them, open one, re-drive or drop them.

A dead letter's clear fields (:class:`broker.streams.DeadLetterMessage`) are for reading only,
marked verified when its MAC holds (a letter a Redis writer added is shown unverified, even one
that kept no entry); a re-drive trusts nothing but a verified letter's sealed
:class:`broker.streams.DeadEntry`, opened as a dead letter, and the original entry's own
authentication (its token or MAC) inside it. The work it names must still be wanted and be what
PostgreSQL holds (a trigger's classpath, task and try: :mod:`broker.trigger_rows`;
:func:`refusal` decides) and not already in flight (the in-flight indexes say so, checked in the
same Lua call that publishes it and deletes the dead letter): a retried entry can therefore
never run beside a live one, and a dead letter is re-driven at most once.
"""

from __future__ import annotations

import datetime as dt
import enum
import re
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import exists, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.replies import Entry
from broker.streams import (
    DeadEntry,
    DeadLetterMessage,
    ForgedEntry,
    MalformedEntry,
    TriggerMessage,
    TriggerSpec,
    dead_letter_verified,
    from_fields,
    one_line,
    open_dead_letter,
    read_event,
    read_queue_entry,
)
from broker.trigger_rows import TriggerRow, spec_check, trigger_rows
from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.runtime.secrets_masker import redact
from deferral.states import TaskState
from deferral.store.tables import ResumeEvent, TaskInstance

# An auto-generated stream id: milliseconds-sequence, each a 64-bit unsigned integer.
_DEAD_ID = re.compile(r"\d{1,20}-\d{1,20}")
# How many entries a filtered listing reads at most per page while it looks for matches.
LIST_PAGE = 1000


def valid_dead_id(text: str) -> bool:
    """Whether ``text`` has the shape of a stream entry id (``1700000000000-0``)."""
    return _DEAD_ID.fullmatch(text) is not None


# -- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadLetter:
    """A dead letter's clear fields, as read (a field it lacks is ''; ``deliveries`` None when
    it is not a number): nothing here is trusted, only shown, escaped."""

    id: str
    added_at: dt.datetime
    source_stream: str
    source_id: str
    task: str
    deliveries: int | None
    consumer: str
    error: str
    sealed: bool  # whether the original entry was kept
    verified: bool  # written by a deferral process (its MAC holds); the rest is unproven


def _verified(cipher: Cipher, entry: Entry) -> bool:
    try:
        return dead_letter_verified(cipher, from_fields(DeadLetterMessage, entry.fields))
    except MalformedEntry:
        return False


def read_dead_letter(cipher: Cipher, entry: Entry) -> DeadLetter:
    def field(name: str, limit: int = 500) -> str:
        return one_line(entry.fields.get(name.encode(), b"").decode(errors="replace"), limit)

    deliveries = field("deliveries", 20)
    return DeadLetter(
        id=entry.id,
        added_at=dt.datetime.fromtimestamp(entry.added_at, dt.UTC),
        source_stream=field("source_stream", 250),
        source_id=field("source_id", 50),
        task=field("task", 250),
        deliveries=int(deliveries) if deliveries.isdigit() else None,
        consumer=field("consumer", 250),
        error=field("error"),
        sealed=bool(entry.fields.get(b"sealed")),
        verified=_verified(cipher, entry),
    )


def _stream_matches(wanted: str, prefix: str, stream: str) -> bool:
    return stream in (wanted, f"{prefix}:{wanted}")


def newest_dead_letters(
    broker: Broker, cipher: Cipher, *, limit: int, stream: str | None = None
) -> list[DeadLetter]:
    """Up to ``limit`` dead letters, newest first; with ``stream`` (a key, or the part after
    the prefix: ``triggers``, ``queue:default``) only those that came from it."""
    if stream is None:
        return [read_dead_letter(cipher, e) for e in broker.newest(broker.keys.dead, limit)]
    found: list[DeadLetter] = []
    before: str | None = None
    while len(found) < limit:
        page = broker.newest(broker.keys.dead, LIST_PAGE, before=before)
        for entry in page:
            letter = read_dead_letter(cipher, entry)
            if _stream_matches(stream, broker.keys.prefix, letter.source_stream):
                found.append(letter)
                if len(found) == limit:
                    break
        if len(page) < LIST_PAGE:
            break
        before = page[-1].id
    return found


class Unopenable(ValueError):
    """A dead letter whose sealed entry cannot be trusted or kept none: why, in one line."""


def open_sealed(broker: Broker, cipher: Cipher, entry: Entry) -> DeadEntry:
    """The original entry sealed in the dead letter ``entry``, checked against its clear
    fields; Unopenable saying why not."""
    try:
        message = from_fields(DeadLetterMessage, entry.fields)
    except MalformedEntry as exc:
        raise Unopenable(f"not a dead letter deferral wrote ({exc})") from None
    if not dead_letter_verified(cipher, message):
        raise Unopenable(
            "unverified: its MAC does not hold (not written by deferral, or with a key no longer"
            " configured)"
        )
    if not message.sealed:
        raise Unopenable("the dead letter kept no entry (it was too large)")
    try:
        sealed = open_dead_letter(cipher, message)
    except msgspec.DecodeError as exc:  # not JSON at all, in a token our key opened
        raise Unopenable(f"its sealed entry is malformed ({exc})") from None
    except ForgedEntry:
        raise Unopenable(
            "its sealed entry failed authentication: forged, or sealed with a key no longer"
            " configured"
        ) from None
    except MalformedEntry as exc:
        raise Unopenable(f"its sealed entry is malformed ({exc})") from None
    if (sealed.stream, sealed.id) != (message.source_stream, message.source_id):
        raise Unopenable("its sealed entry is not the one its clear fields name (copied)")
    return sealed


# -- what a sealed entry asks for ---------------------------------------------------------------


@dataclass(frozen=True)
class TriggerWork:
    spec: TriggerSpec

    @property
    def trigger_id(self) -> int:
        return self.spec.trigger_id

    @property
    def task_instance_id(self) -> int:
        return self.spec.task_instance_id


@dataclass(frozen=True)
class EventWork:
    trigger_id: int
    dedup_key: str


@dataclass(frozen=True)
class QueueWork:
    task_instance_id: int
    try_number: int


Work = TriggerWork | EventWork | QueueWork


def _bytes(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def work_of(broker: Broker, cipher: Cipher, sealed: DeadEntry) -> Work:
    """What the original entry asks for, authenticated as its consumer would (token or MAC);
    Unopenable saying why it cannot be re-driven."""
    keys = broker.keys
    try:
        if keys.is_triggers(sealed.stream):
            message = from_fields(TriggerMessage, _bytes(sealed.fields))
            try:
                spec = msgspec.json.decode(
                    cipher.decrypt(Purpose.TRIGGER_SPEC, message.token), type=TriggerSpec
                )
            except DecryptionError:
                raise ForgedEntry("its token failed authentication") from None
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise MalformedEntry(f"its token holds no trigger ({exc})") from None
            if message.trigger_id != str(spec.trigger_id):
                raise ForgedEntry("its trigger_id is not the one its token names")
            return TriggerWork(spec)
        if keys.is_events(sealed.stream):
            event = read_event(cipher, _bytes(sealed.fields))
            return EventWork(event.trigger_id, event.dedup_key)
        if keys.is_queue(sealed.stream) and len(sealed.stream) > len(keys.queue("")):
            attempt = read_queue_entry(cipher, _bytes(sealed.fields))
            return QueueWork(attempt.task_instance_id, attempt.try_number)
    except (MalformedEntry, ForgedEntry) as exc:
        raise Unopenable(f"the original entry is not valid: {one_line(str(exc), 300)}") from None
    raise Unopenable(f"it came from {one_line(sealed.stream, 100)!r}, not a work stream")


# -- whether the work is still wanted (PostgreSQL) ---------------------------------------------


@dataclass(frozen=True)
class TaskFacts:
    """What PostgreSQL says now of the task an entry names (None: no such task instance)."""

    state: str
    trigger_id: int | None
    try_number: int


@dataclass(frozen=True)
class Facts:
    task: TaskFacts | None
    trigger: TriggerRow | None = None  # trigger entries: the rows their spec names
    event_applied: bool = False  # events: a resume_event row holds the dedup key


def refusal(work: Work, facts: Facts) -> str | None:
    """Why re-driving ``work`` now would be wrong (its task moved on), or None if it is still
    wanted. Pure: the facts are read by :func:`gather_facts`."""
    task = facts.task
    if isinstance(work, TriggerWork | EventWork):
        if task is None:
            return f"no task waits on trigger {work.trigger_id}"
        if task.state != TaskState.DEFERRED or task.trigger_id != work.trigger_id:
            return f"its task is {task.state}, no longer deferred on trigger {work.trigger_id}"
        if isinstance(work, EventWork):
            return (
                f"event {one_line(work.dedup_key, 80)} was applied already"
                if facts.event_applied
                else None
            )
        if facts.trigger is None or facts.trigger.classpath is None:
            return f"trigger {work.trigger_id} no longer exists"
        return spec_check(work.spec, facts.trigger).stale
    if task is None:
        return f"task instance {work.task_instance_id} no longer exists"
    if task.state != TaskState.QUEUED or task.try_number != work.try_number:
        return (
            f"its task is {task.state} at try {task.try_number}, not queued at try"
            f" {work.try_number}"
        )
    return None


def mismatch(work: Work, facts: Facts) -> str | None:
    """The check a trigger entry's spec fails against the rows PostgreSQL holds (classpath,
    task, try), or None: re-driven, it would run something no deferral asked for."""
    if not isinstance(work, TriggerWork) or facts.trigger is None:
        return None
    return spec_check(work.spec, facts.trigger).refused


def gather_facts(session: Session, work: Work) -> Facts:
    ti = TaskInstance
    columns = (ti.state, ti.trigger_id, ti.try_number)
    if isinstance(work, EventWork):
        row = session.execute(
            select(*columns).where(ti.trigger_id == work.trigger_id).order_by(ti.id).limit(1)
        ).one_or_none()
        applied = session.scalar(select(exists().where(ResumeEvent.dedup_key == work.dedup_key)))
        return Facts(None if row is None else TaskFacts(*row), event_applied=bool(applied))
    row = session.execute(select(*columns).where(ti.id == work.task_instance_id)).one_or_none()
    task = None if row is None else TaskFacts(*row)
    if isinstance(work, TriggerWork):
        [trigger] = trigger_rows(session, [work.spec])
        return Facts(task, trigger)
    return Facts(task)


# -- retry and drop ------------------------------------------------------------------------------


class Outcome(enum.StrEnum):
    RETRIED = "retried"
    REFUSED = "refused"  # nothing changed: the reason says why
    UNKNOWN = "unknown"  # no such dead letter (dropped, or retried already)


@dataclass(frozen=True)
class Retry:
    id: str
    outcome: Outcome
    detail: str  # the new entry ("deferral:triggers 1700000000000-0"), or why not


def retry(broker: Broker, sessions: sessionmaker[Session], cipher: Cipher, dead_id: str) -> Retry:
    """Re-drive one dead letter to the stream its sealed entry came from, once, if its work is
    still wanted and not in flight; otherwise change nothing and say why."""
    entry = broker.entry(broker.keys.dead, dead_id)
    if entry is None:
        return Retry(dead_id, Outcome.UNKNOWN, f"no dead letter {dead_id} (dropped or retried)")
    try:
        sealed = open_sealed(broker, cipher, entry)
        work = work_of(broker, cipher, sealed)
    except Unopenable as exc:
        return Retry(dead_id, Outcome.REFUSED, str(exc))
    with sessions() as session:
        facts = gather_facts(session, work)
    wrong = mismatch(work, facts)
    if wrong is not None:
        return Retry(dead_id, Outcome.REFUSED, f"not what PostgreSQL holds: {wrong}")
    why = refusal(work, facts)
    if why is not None:
        return Retry(dead_id, Outcome.REFUSED, f"stale: {why}")
    stream, others = _redrive_streams(broker, sealed.stream, work)
    done = broker.redrive_dead(dead_id, stream, sealed.fields, also_not_in=others)
    if done.status == 0:
        return Retry(dead_id, Outcome.UNKNOWN, f"no dead letter {dead_id} (dropped or retried)")
    if done.status < 0:
        return Retry(
            dead_id, Outcome.REFUSED, f"its work is in flight already (entry {done.entry_id})"
        )
    return Retry(dead_id, Outcome.RETRIED, f"{stream} {done.entry_id}")


def _redrive_streams(broker: Broker, came_from: str, work: Work) -> tuple[str, list[str]]:
    """Where an entry from ``came_from`` is re-driven to, and the other streams that may carry
    its work. A trigger's work is in flight as its entry or as its event, whichever stream of
    its shard holds it: those are the streams of its trigger id's shard (one slot), whichever
    the entry came from."""
    keys = broker.keys
    if isinstance(work, TriggerWork):
        stream = keys.trigger_stream(keys.queue_of_triggers(came_from), work.trigger_id)
        return stream, [keys.events_beside(stream)]
    if isinstance(work, EventWork):
        stream = keys.events_for(work.trigger_id)
        return stream, [s for s in broker.trigger_streams() if keys.events_beside(s) == stream]
    return came_from, []


def drop(broker: Broker, dead_ids: list[str]) -> dict[str, bool]:
    """Delete dead letters; for each id, whether there was one."""
    return broker.drop_dead(dead_ids) if dead_ids else {}


# -- revealing a sealed entry ----------------------------------------------------------------------


def revealed(cipher: Cipher, sealed: DeadEntry) -> dict[str, Any]:
    """The original entry for an operator's eyes, secrets masked: a trigger's kwargs opened from
    its token, an event's payload parsed; MACs and tokens (ciphertext) left out."""
    shown: dict[str, Any] = {}
    for name, value in sealed.fields.items():
        if name == "mac":
            continue
        if name == "token":
            try:
                spec = msgspec.json.decode(
                    cipher.decrypt(Purpose.TRIGGER_SPEC, value), type=TriggerSpec
                )
                shown["kwargs"] = spec.kwargs
                shown["task_instance_id"] = spec.task_instance_id
                shown["try_number"] = spec.try_number
            except (DecryptionError, msgspec.ValidationError, msgspec.DecodeError):
                shown["token"] = "(does not open with the configured keys)"
            continue
        if name == "payload":
            try:
                shown[name] = msgspec.json.decode(value)
            except msgspec.DecodeError:
                shown[name] = value
            continue
        shown[name] = value
    return {
        "stream": sealed.stream,
        "id": sealed.id,
        "error": sealed.error,
        "deliveries": sealed.deliveries,
        "fields": redact(shown),
    }
