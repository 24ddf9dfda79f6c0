"""Every stream key, consumer group and field of the project, with their message schemas.

Field values are short strings or JSON so that ``redis-cli XRANGE <key> - +`` reads well; nothing
secret is ever a field in clear: trigger kwargs travel only inside the Fernet ``token``, an
event's payload and carried log lines only sealed (Fernet) in its ``payload`` and ``log``.

Every entry that can change a task's state is authenticated: a trigger entry by its Fernet token,
an event or queue entry by ``mac`` (an HMAC keyed from the Fernet keys). An entry is turned into
typed data only here, after its MAC and every field have been checked, so nothing unchecked
reaches SQL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.runtime.redis_urls import MAX_STREAM_SHARDS, default_stream_shards, is_cluster_url
from deferral.states import END_KINDS
from deferral.store.far_timers import TriggerWaiter

GROUP_TRIGGERERS = "triggerers"
GROUP_SCHEDULERS = "schedulers"
GROUP_WORKERS = "workers"

# The queue of a task that names none (``BaseOperator.queue``): its triggers stream is
# ``<prefix>:triggers``, as before triggers had queues.
DEFAULT_QUEUE = "default"

EVENT_KIND_EVENT = "event"
EVENT_KIND_FAILURE = "failure"
# A task-end event (end_from_trigger) is an event of its own kind: its task ends in that state.
EVENT_KINDS = (EVENT_KIND_EVENT, EVENT_KIND_FAILURE, *END_KINDS.values())

# An events entry that only asks a scheduler to look at Postgres now (a worker recorded an
# outcome: a task's end marked its run, and any outcome freed a pool slot), instead of after its
# blocking read times out. It is not signed and names nothing: what a scheduler then does is read
# from Postgres, so a forged one costs a scheduler loop and changes no state.
WAKE_FIELD = "wake"
WAKE: dict[str, str] = {WAKE_FIELD: "marked runs"}


def is_wake(fields: Mapping[bytes, bytes]) -> bool:
    """Whether an events entry is a :data:`WAKE` (and no event)."""
    return fields.keys() == {WAKE_FIELD.encode()}


# An events entry reporting a trigger's progress (``TriggerProgress``) names its trigger in this
# field, not in ``trigger_id``: it is not the trigger's event, so the in-flight index (which
# says which entry carries a trigger's event) never points at it.
PROGRESS_FIELD = "progress_of"
# The most a progress payload's JSON may hold: it is recorded in PostgreSQL and shown on the task
# page, a status and not a result (a larger one is not sent; the triggerer logs it).
MAX_PROGRESS_PAYLOAD = 8 * 1024
# ...and sealed, on the wire, checked before anything is decrypted.
MAX_SEALED_PROGRESS = (MAX_PROGRESS_PAYLOAD + 16 + 73) * 4 // 3 + 4


def is_progress(fields: Mapping[bytes, bytes]) -> bool:
    """Whether an events entry reports progress (and is no event)."""
    return PROGRESS_FIELD.encode() in fields


# Postgres bigint and integer: an id outside them must be refused before it reaches SQL.
MAX_BIGINT = 2**63 - 1
MAX_INT = 2**31 - 1
MAX_DEDUP_KEY = 250  # resume_event.dedup_key


def shard_of(trigger_id: int, shards: int) -> int:
    """The logical shard (0..shards-1) whose triggers and events streams carry ``trigger_id``.
    Trigger ids are a sequence, so the remainder spreads them evenly; it must never change for
    a given count (an entry's stream is found again from its id: the reconciler, re-drives)."""
    return trigger_id % shards


class StreamKeys:
    """Key names under one prefix (``DEFERRAL_STREAM_PREFIX``, default ``deferral``).

    Each work stream has an *in-flight index*, a hash from the id of what an entry is about
    (trigger id, task instance id) to the entry's id. It is written and cleared in the same Lua
    calls that add and retire entries, so it always says which entry currently carries a piece of
    work; the scheduler's reconciler compares it with Postgres and republishes what is missing.

    The triggers streams (one per task queue) and the events stream are split into ``shards``
    logical shards (``DEFERRAL_STREAM_SHARDS``), a trigger's chosen by :func:`shard_of`; a
    shard's streams and indexes share a prefix, and on a Redis Cluster (``hash_tagged``) the hash
    tag ``{shard:NN}``, so that every Lua call (a trigger's event is handed on from one to the
    other atomically) touches one slot. Each queue stream and its index share the tag
    ``{queue:<name>}``. One shard on one Redis keeps the plain names (``deferral:triggers``,
    ``deferral:inflight:triggers``). See broker/DECISIONS.md.
    """

    def __init__(self, prefix: str = "deferral", *, hash_tagged: bool = False, shards: int = 1):
        if not 1 <= shards <= MAX_STREAM_SHARDS:
            raise ValueError(f"shards must be 1..{MAX_STREAM_SHARDS}, not {shards}")
        self.prefix = prefix
        self.hash_tagged = hash_tagged
        self.shards = shards
        self._bases = [self._shard_base(n) for n in range(shards)]
        self.triggers = f"{self._bases[0]}triggers"  # the default queue's, shard 0
        self.events = f"{self._bases[0]}events"  # shard 0's
        self.all_events = [f"{base}events" for base in self._bases]
        self._events = frozenset(self.all_events)
        self._events_of_triggers = {f"{base}triggers": f"{base}events" for base in self._bases}
        bases = "|".join(re.escape(f"{base}triggers") for base in self._bases)
        self._triggers = re.compile(f"(?:{bases})(?::|$)")
        self.dead = f"{prefix}:dead"
        # A set naming every queue stream, so that listing them never scans the keyspace.
        self.queues = f"{prefix}:queues"
        # The shard count this prefix was started with: fixed once chosen (Broker.check_shards).
        self.shard_count = f"{prefix}:shards"

    def _shard_base(self, shard: int) -> str:
        if self.hash_tagged:
            return f"{self.prefix}:{{shard:{shard:02d}}}:"
        return f"{self.prefix}:" if self.shards == 1 else f"{self.prefix}:shard:{shard:02d}:"

    @classmethod
    def for_redis(cls, prefix: str, redis_url: str, shards: int | None = None) -> StreamKeys:
        """The keys of ``prefix`` on the Redis ``redis_url`` names (hash-tagged on a cluster),
        in ``shards`` shards (default: :func:`default_stream_shards` of the URL)."""
        count = default_stream_shards(redis_url) if shards is None else shards
        return cls(prefix, hash_tagged=is_cluster_url(redis_url), shards=count)

    def queue(self, name: str) -> str:
        if self.hash_tagged:
            return f"{self.prefix}:{{queue:{name}}}"
        return f"{self.prefix}:queue:{name}"

    def shard_of(self, trigger_id: int | str) -> int:
        return shard_of(int(trigger_id), self.shards)

    def triggers_for(self, queue: str, shard: int = 0) -> str:
        """The triggers stream of a task queue in ``shard``: the default queue's has no suffix."""
        stream = f"{self._bases[shard]}triggers"
        return stream if queue == DEFAULT_QUEUE else f"{stream}:{queue}"

    def triggers_of(self, queue: str) -> list[str]:
        """Every shard's triggers stream of a task queue (what a triggerer serving it reads)."""
        return [self.triggers_for(queue, shard) for shard in range(self.shards)]

    def trigger_stream(self, queue: str, trigger_id: int | str) -> str:
        """The triggers stream that carries ``trigger_id`` of a task in ``queue``."""
        return self.triggers_for(queue, self.shard_of(trigger_id))

    def events_for(self, trigger_id: int | str) -> str:
        """The events stream of ``trigger_id``'s shard (its triggers entry's slot)."""
        return self.all_events[self.shard_of(trigger_id)]

    def queue_of_triggers(self, stream: str) -> str:
        """The task queue whose triggers stream ``stream`` is (see :meth:`is_triggers`)."""
        return stream[self._triggers_head(stream) :] or DEFAULT_QUEUE

    def events_beside(self, triggers: str) -> str:
        """The events stream in the shard (the slot) of the triggers stream ``triggers``: where
        its entries are handed on to, whatever trigger id an entry claims."""
        head = triggers[: self._triggers_head(triggers)].removesuffix(":")
        return self._events_of_triggers[head]

    def _triggers_head(self, stream: str) -> int:
        found = self._triggers.match(stream)
        if found is None:
            raise ValueError(f"{stream!r} is not a triggers stream of {self.prefix!r}")
        return found.end()

    def is_triggers(self, stream: str) -> bool:
        """Whether ``stream`` is a triggers stream (of any queue and shard)."""
        return self._triggers.match(stream) is not None

    def is_events(self, stream: str) -> bool:
        """Whether ``stream`` is an events stream (of any shard)."""
        return stream in self._events

    def is_queue(self, stream: str) -> bool:
        """Whether ``stream`` is a queue stream of this prefix."""
        start = f"{self.prefix}:{{queue:" if self.hash_tagged else f"{self.prefix}:queue:"
        return stream.startswith(start)

    def inflight(self, stream: str) -> str:
        """The in-flight index of ``stream`` (in its slot when hash-tagged)."""
        return self._beside(stream, "inflight")

    def _beside(self, stream: str, kind: str) -> str:
        if self.hash_tagged:
            return f"{stream}:{kind}"
        return f"{self.prefix}:{kind}:{stream.removeprefix(self.prefix + ':')}"

    def started(self, stream: str) -> str:
        """The start evidence of ``stream`` (in its slot): entry id -> the deliveries counted
        against it, for each entry a consumer started and that has not yet survived a heartbeat
        (broker/DECISIONS.md, rule 31)."""
        return self._beside(stream, "started")

    def suspect(self, stream: str) -> str:
        """The group-wide suspect claim of ``stream`` (in its slot): ``<entry id> <consumer>``
        of the one suspect entry running, expiring with its holder's lease."""
        return self._beside(stream, "suspect")

    def index_field(self, stream: str, fields: Mapping[str, str]) -> str:
        """The index field of an entry: what the entry is about ('' for an unindexed stream)."""
        if stream in self._events or self.is_triggers(stream):
            return fields.get("trigger_id", "")
        if self.is_queue(stream):
            return fields.get("task_instance_id", "")
        return ""


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A stream entry's fields; every field is a string on the wire."""


class TriggerMessage(Message, frozen=True):
    """``deferral:triggers``: a trigger to run. ``token`` seals the full :class:`TriggerSpec`."""

    trigger_id: str
    classpath: str
    task: str  # dag.run.task[map], for people reading the stream
    token: str


class EventMessage(Message, frozen=True):
    """``deferral:events``: what a trigger produced (``kind`` event) or why it failed (failure).
    The payload may hold a secret (an HTTP response, a token), and the carried log lines may
    quote it: both travel sealed with the Fernet keys, and the MAC covers the sealed text."""

    trigger_id: str
    dedup_key: str
    kind: str
    payload: str  # Fernet token of the payload's JSON
    triggerer: str
    mac: str
    # The triggerer's lines for the log of the try that deferred (a Fernet token of a JSON
    # :class:`CarriedLog`; '' for none, then left out of the MAC, as entries without it were
    # signed).
    log: str = ""


class ProgressMessage(Message, frozen=True):
    """``deferral:events``: what a trigger reported before its event (``TriggerProgress``),
    its payload sealed as an event's, every field signed."""

    progress_of: str  # the trigger id
    payload: str  # Fernet token of the payload's JSON
    triggerer: str
    mac: str


class QueueMessage(Message, frozen=True):
    """``deferral:queue:<queue>``: a task attempt to run."""

    task_instance_id: str
    try_number: str
    task: str
    mac: str


class TriggerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the token of a :class:`TriggerMessage` decrypts to."""

    trigger_id: int
    classpath: str
    kwargs: dict[str, object]  # serialization.to_jsonable form
    task_instance_id: int
    task: str
    # The try that deferred, whose log the triggerer writes to (0: an entry written before
    # tokens carried it; the triggerer then reads the task instance's current try).
    try_number: int = 0


class DeadLetterMessage(Message, frozen=True):
    """``deferral:dead``: an entry a consumer set aside. In clear: where it came from, one bounded
    line of why, how often it was delivered, the task it named and who set it aside. The original
    entry is in ``sealed`` (a Fernet token of a :class:`DeadEntry`; '' when it was too large to
    keep), so neither a payload nor a traceback is ever in clear. ``mac`` authenticates every
    other field (a dead letter's own MAC key): a letter a Redis writer added is told apart, even
    one that kept no entry ('' in letters written before it existed)."""

    source_stream: str
    source_id: str
    error: str
    deliveries: str
    task: str
    consumer: str
    sealed: str
    mac: str = ""


class DeadEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a dead letter's ``sealed`` opens to: the original entry, with the stream and id it
    had, so that a tool re-driving it trusts only what the key authenticates."""

    stream: str
    id: str
    fields: dict[str, str]
    error: str
    deliveries: int


# A dead letter's clear text is bounded whatever the entry held.
MAX_DEAD_ERROR = 500
MAX_DEAD_LABEL = 250
# An original entry larger than this is not kept (nothing legitimate comes close: the largest are
# trigger tokens of a few KB); its dead letter says how large it was.
MAX_KEPT_ENTRY_BYTES = 256 * 1024
MAX_KEPT_ENTRY_FIELDS = 32


def one_line(text: str, limit: int) -> str:
    """``text`` on one line of at most ``limit`` characters: control characters escaped (a
    newline in an attacker's field must not forge a line wherever it is shown)."""
    cleaned = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text[: limit * 4])
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "\u2026"


M = TypeVar("M", bound=Message)


class MalformedEntry(ValueError):
    """A stream entry whose fields do not match the stream's schema, or fail their checks."""


class ForgedEntry(ValueError):
    """A stream entry whose MAC does not authenticate it: it must change nothing."""


def to_fields(message: Message) -> dict[str, str]:
    return msgspec.structs.asdict(message)


def from_fields(kind: type[M], fields: Mapping[bytes, bytes]) -> M:
    try:
        decoded = {k.decode(): v.decode() for k, v in fields.items()}
        return msgspec.convert(decoded, kind)
    except (UnicodeDecodeError, msgspec.ValidationError) as exc:
        raise MalformedEntry(f"malformed {kind.__name__}: {exc}") from None


def task_label(dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    label = f"{dag_id}.{run_id}.{task_id}"
    return label if map_index < 0 else f"{label}[{map_index}]"


def _signed_part(values: tuple[str, ...]) -> bytes:
    # A JSON array: unambiguous whatever the values hold.
    return msgspec.json.encode(values)


def _sign(cipher: Cipher, *values: str) -> str:
    return cipher.sign(Purpose.STREAM_ENTRY, _signed_part(values))


def _authenticate(cipher: Cipher, message: EventMessage | QueueMessage) -> None:
    values = tuple(
        v for k, v in msgspec.structs.asdict(message).items() if k != "mac" and (k != "log" or v)
    )
    if not cipher.verify(Purpose.STREAM_ENTRY, _signed_part(values), message.mac):
        raise ForgedEntry(f"{type(message).__name__} failed authentication (forged or corrupted)")


def positive_id(text: str, name: str, maximum: int = MAX_BIGINT) -> int:
    """A decimal id in 1..maximum, or MalformedEntry naming the field."""
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise MalformedEntry(f"{name} {text[:40]!r} is not a positive integer")
    value = int(text)
    if not 1 <= value <= maximum:
        raise MalformedEntry(f"{name} {value} is out of range (1..{maximum})")
    return value


# -- dead letters ---------------------------------------------------------------------------


def _dead_letter_part(message: DeadLetterMessage) -> bytes:
    return _signed_part(tuple(v for k, v in msgspec.structs.asdict(message).items() if k != "mac"))


def signed_dead_letter(cipher: Cipher, message: DeadLetterMessage) -> DeadLetterMessage:
    """``message`` with the MAC of its other fields."""
    mac = cipher.sign(Purpose.DEAD_LETTER, _dead_letter_part(message))
    return msgspec.structs.replace(message, mac=mac)


def dead_letter_verified(cipher: Cipher, message: DeadLetterMessage) -> bool:
    """Whether a deferral process wrote this dead letter as it reads (its MAC holds)."""
    return bool(message.mac) and cipher.verify(
        Purpose.DEAD_LETTER, _dead_letter_part(message), message.mac
    )


def open_dead_letter(cipher: Cipher, message: DeadLetterMessage) -> DeadEntry:
    """The original entry sealed in a dead letter; ForgedEntry if the key does not open it, and
    MalformedEntry if it kept none (too large) or holds something else."""
    if not dead_letter_verified(cipher, message):
        raise ForgedEntry("the dead letter failed authentication (its MAC does not hold)")
    if not message.sealed:
        raise MalformedEntry("the dead letter kept no entry (it was too large)")
    try:
        plain = cipher.decrypt(Purpose.DEAD_LETTER, message.sealed)
    except DecryptionError:
        raise ForgedEntry("the dead letter's sealed entry failed authentication") from None
    try:
        return msgspec.json.decode(plain, type=DeadEntry)
    except msgspec.ValidationError as exc:
        raise MalformedEntry(f"malformed DeadEntry: {exc}") from None


# -- triggers -------------------------------------------------------------------------------


def trigger_message(
    cipher: Cipher,
    *,
    trigger_id: int,
    classpath: str,
    kwargs: dict[str, object],
    task_instance_id: int,
    try_number: int,
    task: str,
) -> TriggerMessage:
    """A triggers-stream entry: readable fields, and the whole spec sealed in the token."""
    spec = TriggerSpec(trigger_id, classpath, kwargs, task_instance_id, task, try_number)
    token = cipher.encrypt(Purpose.TRIGGER_SPEC, msgspec.json.encode(spec))
    return TriggerMessage(trigger_id=str(trigger_id), classpath=classpath, task=task, token=token)


def waiter_entry(
    cipher: Cipher, keys: StreamKeys, waiter: TriggerWaiter
) -> tuple[str, dict[str, str]]:
    """The triggers-stream entry (stream, fields) of a committed trigger row naming a task that
    waits on it: its kwargs opened from the row and sealed anew with the task in the token.
    Raises DecryptionError or msgspec.DecodeError when the row's kwargs no longer open."""
    message = trigger_message(
        cipher,
        trigger_id=waiter.trigger_id,
        classpath=waiter.classpath,
        kwargs=msgspec.json.decode(cipher.decrypt(Purpose.TRIGGER_KWARGS, waiter.kwargs_token)),
        task_instance_id=waiter.task_instance_id,
        try_number=waiter.try_number,
        task=task_label(waiter.dag_id, waiter.run_id, waiter.task_id, waiter.map_index),
    )
    stream = keys.trigger_stream(waiter.queue, waiter.trigger_id)
    return stream, msgspec.structs.asdict(message)


# -- events ---------------------------------------------------------------------------------


# The most a carried log may hold (its JSON); a triggerer stores a longer one itself.
MAX_CARRIED_LOG = 32 * 1024
# ...and sealed, on the wire (Fernet: base64 of the padded text plus 73 bytes), checked before
# anything is decrypted.
MAX_SEALED_LOG = (MAX_CARRIED_LOG + 16 + 73) * 4 // 3 + 4


class CarriedLog(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Lines for one try's log that travel with an event: the scheduler stores them in the
    transaction that applies it, so they precede whatever the resumed attempt writes."""

    task_instance_id: int
    try_number: int
    lines: list[tuple[float, str]]  # (time, POSIX seconds; text)


@dataclass(frozen=True)
class Event:
    """An authenticated, checked ``deferral:events`` entry."""

    trigger_id: int
    dedup_key: str
    failed: bool
    payload: str  # JSON (opened), decoded by the scheduler
    triggerer: str
    log: CarriedLog | None = None
    sealed_payload: str = ""  # the payload as the entry carries it (a Fernet token)
    ends: str = ""  # the kind of a task-end event; '' for any other


def event_message(
    cipher: Cipher, trigger_id: int, dedup_key: str, kind: str, payload: str, triggerer: str
) -> EventMessage:
    """An events-stream entry: ``payload`` (JSON) sealed, every field signed."""
    sealed = cipher.encrypt(Purpose.EVENT, payload.encode())
    mac = _sign(cipher, str(trigger_id), dedup_key, kind, sealed, triggerer)
    return EventMessage(str(trigger_id), dedup_key, kind, sealed, triggerer, mac)


def with_log(cipher: Cipher, message: EventMessage, log: CarriedLog) -> EventMessage:
    """``message`` carrying ``log`` (sealed, signed with it); MalformedEntry if it would not
    fit."""
    carried = msgspec.json.encode(log)
    if len(carried) > MAX_CARRIED_LOG:
        raise MalformedEntry(f"a carried log of {len(carried)} characters is too long")
    sealed = cipher.encrypt(Purpose.CARRIED_LOG, carried)
    m = message
    mac = _sign(cipher, m.trigger_id, m.dedup_key, m.kind, m.payload, m.triggerer, sealed)
    return msgspec.structs.replace(message, mac=mac, log=sealed)


def _open(cipher: Cipher, purpose: Purpose, sealed: str, name: str) -> bytes:
    """A sealed field's text; ForgedEntry if no key opens it (the MAC held, so it was sealed
    with a key that signs but does not open: a misconfiguration, or a forgery)."""
    try:
        return cipher.decrypt(purpose, sealed)
    except DecryptionError:
        raise ForgedEntry(
            f"{name} failed authentication (forged, corrupted or unknown key)"
        ) from None


def _carried_log(text: bytes) -> CarriedLog | None:
    if not text:
        return None
    if len(text) > MAX_CARRIED_LOG:
        raise MalformedEntry(f"log is longer than {MAX_CARRIED_LOG} characters")
    try:
        log = msgspec.json.decode(text, type=CarriedLog)
    except msgspec.ValidationError as exc:
        raise MalformedEntry(f"log is not a carried log: {exc}") from None
    positive_id(str(log.task_instance_id), "log task_instance_id")
    positive_id(str(log.try_number), "log try_number", MAX_INT)
    return log


def read_event(cipher: Cipher, fields: Mapping[bytes, bytes]) -> Event:
    """The event an entry carries, its payload and log opened; MalformedEntry or ForgedEntry
    saying why not. Fields are checked before the MAC so that the reason names a bad field
    precisely; the sealed fields are opened only once the MAC holds."""
    message = from_fields(EventMessage, fields)
    trigger_id = positive_id(message.trigger_id, "trigger_id")
    if message.kind not in EVENT_KINDS:
        raise MalformedEntry(f"unknown event kind {message.kind[:40]!r}")
    if not 0 < len(message.dedup_key) <= MAX_DEDUP_KEY:
        raise MalformedEntry(f"dedup_key must be 1..{MAX_DEDUP_KEY} characters")
    if len(message.log) > MAX_SEALED_LOG:
        raise MalformedEntry(f"log is longer than {MAX_SEALED_LOG} characters")
    _authenticate(cipher, message)
    payload = _open(cipher, Purpose.EVENT, message.payload, "payload")
    log = (
        _carried_log(_open(cipher, Purpose.CARRIED_LOG, message.log, "log"))
        if message.log
        else None
    )
    try:
        payload_text = payload.decode()
    except UnicodeDecodeError:
        raise MalformedEntry("payload is not UTF-8 text") from None
    return Event(
        trigger_id,
        message.dedup_key,
        message.kind == EVENT_KIND_FAILURE,
        payload_text,
        message.triggerer,
        log,
        message.payload,
        message.kind if message.kind in END_KINDS.values() else "",
    )


# -- progress -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """An authenticated, checked progress entry: its payload stays sealed (it is recorded as
    it is, and opened only where it is shown)."""

    trigger_id: int
    sealed_payload: str
    triggerer: str


def progress_message(
    cipher: Cipher, trigger_id: int, payload: str, triggerer: str
) -> ProgressMessage:
    """A progress entry: ``payload`` (JSON) sealed, every field signed; MalformedEntry if the
    payload is longer than :data:`MAX_PROGRESS_PAYLOAD`."""
    if len(payload.encode()) > MAX_PROGRESS_PAYLOAD:
        raise MalformedEntry(
            f"a progress payload of {len(payload.encode())} bytes is over {MAX_PROGRESS_PAYLOAD}"
        )
    sealed = cipher.encrypt(Purpose.EVENT, payload.encode())
    mac = _sign(cipher, PROGRESS_FIELD, str(trigger_id), sealed, triggerer)
    return ProgressMessage(str(trigger_id), sealed, triggerer, mac)


def read_progress(cipher: Cipher, fields: Mapping[bytes, bytes]) -> Progress:
    """The progress an entry reports; MalformedEntry or ForgedEntry saying why not."""
    message = from_fields(ProgressMessage, fields)
    trigger_id = positive_id(message.progress_of, PROGRESS_FIELD)
    if len(message.payload) > MAX_SEALED_PROGRESS:
        raise MalformedEntry(f"payload is longer than {MAX_SEALED_PROGRESS} characters")
    m = message
    signed = _signed_part((PROGRESS_FIELD, m.progress_of, m.payload, m.triggerer))
    if not cipher.verify(Purpose.STREAM_ENTRY, signed, m.mac):
        raise ForgedEntry("ProgressMessage failed authentication (forged or corrupted)")
    return Progress(trigger_id, message.payload, message.triggerer)


# -- queues ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueuedAttempt:
    """An authenticated, checked ``deferral:queue:<queue>`` entry."""

    task_instance_id: int
    try_number: int
    task: str


def queue_message(
    cipher: Cipher,
    task_instance_id: int,
    try_number: int,
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int,
) -> QueueMessage:
    task = task_label(dag_id, run_id, task_id, map_index)
    mac = _sign(cipher, str(task_instance_id), str(try_number), task)
    return QueueMessage(str(task_instance_id), str(try_number), task, mac)


def read_queue_entry(cipher: Cipher, fields: Mapping[bytes, bytes]) -> QueuedAttempt:
    """The attempt an entry names; MalformedEntry or ForgedEntry saying why not."""
    message = from_fields(QueueMessage, fields)
    attempt = QueuedAttempt(
        positive_id(message.task_instance_id, "task_instance_id"),
        positive_id(message.try_number, "try_number", MAX_INT),
        message.task,
    )
    _authenticate(cipher, message)
    return attempt
