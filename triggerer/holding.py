"""The triggers a triggerer holds (:class:`HeldTriggers`, by trigger id), far timers among them
kept dozing in columns (:class:`FarTimers`) rather than as a :class:`Held` each.

A timer due in more than ``DOZE_AHEAD`` is a row of a bucket of the timers due within the same
``BUCKET`` (its trigger id, task instance id, try number, moment, entry id, stream and task
label in arrays and one bytes blob): no Python object, no dict slot and no heap slot per timer,
and nothing per timer left among the garbage of the take-in (triggerer rule 37). A bucket wakes
(its timers become ``Held``s on the timers' heap) ``DOZE_AHEAD`` before it begins; a dozing
timer that anything asks for by id (a cancellation, a republished entry) wakes alone.
"""

from __future__ import annotations

import datetime as dt
import heapq
from array import array
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterator, MutableMapping
from itertools import compress

from broker.replies import Entry
from triggerer.held import Held

# The timers due within one bucket of this width doze together and wake together. A bucket's
# own columns cost about a kilobyte: with held timers within DEFERRAL_FAR_TIMER_HORIZON_SEC
# (far ones wait as rows), at most a kilobyte per minute of the horizon.
BUCKET = dt.timedelta(seconds=60)
# How long before its bucket begins a dozing timer wakes (the timers' heap then seals its
# event SEAL_AHEAD before its moment, as for any timer); a timer due sooner never dozes.
DOZE_AHEAD = dt.timedelta(seconds=20)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_US = dt.timedelta(microseconds=1)
_BUCKET_US = BUCKET // _US
# An index entry whose timer no longer dozes (woken, removed).
_GONE = -1


def micros(moment: dt.datetime) -> int:
    """A UTC moment in microseconds since the epoch (exact, unlike a float timestamp)."""
    return (moment - _EPOCH) // _US


class _Bucket:
    """The timers dozing in one bucket, a row each (a woken or removed row's id is -1)."""

    __slots__ = (
        "ends",
        "ids",
        "labels",
        "left",
        "moments",
        "seqs",
        "stamps",
        "streams",
        "task_instances",
        "tries",
    )

    def __init__(self) -> None:
        self.ids = array("q")
        self.task_instances = array("q")
        self.tries = array("l")
        self.moments = array("q")  # microseconds since the epoch
        self.stamps = array("q")  # entry id: milliseconds
        self.seqs = array("q")  # entry id: sequence number
        self.streams = array("H")  # index in FarTimers.streams
        self.ends = array("L")  # where each row's task label ends in ``labels``
        self.labels = bytearray()
        self.left = 0  # rows not woken or removed


class FarTimers:
    """Timers dozing in columns, by bucket; ``ids`` is the sorted index of their trigger ids
    (``buckets`` aligned with it: each one's bucket, _GONE once it no longer dozes; the index is
    rebuilt once more than half of it is gone: a woken bucket moves nothing in it)."""

    def __init__(self) -> None:
        self.ids = array("q")
        self.buckets = array("q")
        self.gone = 0  # index entries _GONE
        self.by_bucket: dict[int, _Bucket] = {}
        self.starts: list[int] = []  # a heap of bucket numbers (lazily cleaned)
        self.streams: list[str] = []
        self.stream_index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.ids) - self.gone

    def holds(self, trigger_id: int) -> bool:
        return self._find(trigger_id) is not None

    def trigger_ids(self) -> list[int]:
        return [tid for tid, number in zip(self.ids, self.buckets, strict=True) if number != _GONE]

    def _find(self, trigger_id: int) -> int | None:
        """Where ``trigger_id`` dozes in the index, None if it does not."""
        i = bisect_left(self.ids, trigger_id)
        if i < len(self.ids) and self.ids[i] == trigger_id and self.buckets[i] != _GONE:
            return i
        return None

    def put(self, held: Held) -> bool:
        """Keep ``held`` dozing; False if it cannot be kept in columns (not a plain timer, a
        moment not in UTC, an entry id Redis would not make)."""
        moment, (stamp, dash, seq) = held.moment, held.entry_id.partition("-")
        if (
            moment is None
            or moment.tzinfo is not dt.UTC
            or held.scope is not None
            or held.cancelled
            or not (dash and stamp.isdigit() and seq.isdigit())
            or self.holds(held.trigger_id)
        ):
            return False
        stream = self.stream_index.get(held.stream)
        if stream is None:
            if len(self.streams) >= 1 << 16:
                return False
            stream = self.stream_index[held.stream] = len(self.streams)
            self.streams.append(held.stream)
        at = micros(moment)
        number = at // _BUCKET_US
        bucket = self.by_bucket.get(number)
        if bucket is None:
            bucket = self.by_bucket[number] = _Bucket()
            heapq.heappush(self.starts, number)
        bucket.ids.append(held.trigger_id)
        bucket.task_instances.append(held.task_instance_id)
        bucket.tries.append(held.try_number)
        bucket.moments.append(at)
        bucket.stamps.append(int(stamp))
        bucket.seqs.append(int(seq))
        bucket.streams.append(stream)
        bucket.labels += held.task.encode()
        bucket.ends.append(len(bucket.labels))
        bucket.left += 1
        i = bisect_left(self.ids, held.trigger_id)
        if i < len(self.ids) and self.ids[i] == held.trigger_id:  # dozed before: its entry
            self.buckets[i] = number
            self.gone -= 1
        else:
            self.ids.insert(i, held.trigger_id)
            self.buckets.insert(i, number)
        return True

    def next_wake(self) -> dt.datetime | None:
        """When the earliest bucket wakes (None: nothing dozes)."""
        number = self._earliest()
        if number is None:
            return None
        return _EPOCH + number * BUCKET - DOZE_AHEAD

    def wake_due(self, now: dt.datetime, limit: int) -> list[Held]:
        """Up to ``limit`` timers of the buckets whose wake time has come, as ``Held``s; they
        no longer doze."""
        woken: list[Held] = []
        due = micros(now + DOZE_AHEAD) // _BUCKET_US
        while len(woken) < limit and (number := self._earliest()) is not None and number <= due:
            bucket = self.by_bucket[number]
            # From the end: the columns shrink without moving what is left.
            while bucket.ids and len(woken) < limit:
                row = len(bucket.ids) - 1
                if bucket.ids[row] >= 0:
                    woken.append(self._held(bucket, row))
                    bucket.left -= 1
                for column in (bucket.ids, bucket.task_instances, bucket.tries, bucket.moments):
                    del column[row]
                for column in (bucket.stamps, bucket.seqs, bucket.streams, bucket.ends):
                    del column[row]
                del bucket.labels[bucket.ends[row - 1] if row else 0 :]
            if not bucket.left:
                del self.by_bucket[number]
        for held in woken:
            self._unindex(bisect_left(self.ids, held.trigger_id))
        return woken

    def pop(self, trigger_id: int) -> Held | None:
        """The dozing timer of ``trigger_id`` as a ``Held`` (it no longer dozes), else None."""
        i = self._find(trigger_id)
        if i is None:
            return None
        number = self.buckets[i]
        self._unindex(i)
        bucket = self.by_bucket[number]
        row = bucket.ids.index(trigger_id)
        held = self._held(bucket, row)
        bucket.ids[row] = -1
        bucket.left -= 1
        if not bucket.left:
            del self.by_bucket[number]
        return held

    def rows(self) -> Iterator[tuple[_Bucket, int]]:
        for bucket in self.by_bucket.values():
            for row, trigger_id in enumerate(bucket.ids):
                if trigger_id >= 0:
                    yield bucket, row

    def task_instances(self) -> tuple[list[int], list[int]]:
        """The trigger ids dozing and their task instance ids, in two lists."""
        trigger_ids: list[int] = []
        ti_ids: list[int] = []
        for bucket in self.by_bucket.values():
            # A whole bucket's columns at once: this runs on the event loop every heartbeat.
            if bucket.left == len(bucket.ids):
                trigger_ids += bucket.ids
                ti_ids += bucket.task_instances
            else:
                kept = [trigger_id >= 0 for trigger_id in bucket.ids]
                trigger_ids += compress(bucket.ids, kept)
                ti_ids += compress(bucket.task_instances, kept)
        return trigger_ids, ti_ids

    def keyed(self, keys: Collection[tuple[str, str]]) -> list[int]:
        """The trigger ids dozing whose entry is one of ``keys`` (stream, entry id)."""
        wanted = set()
        for stream, entry_id in keys:
            index = self.stream_index.get(stream)
            stamp, _, seq = entry_id.partition("-")
            if index is not None and stamp.isdigit() and seq.isdigit():
                wanted.add((index, int(stamp), int(seq)))
        if not wanted:
            return []
        return [
            bucket.ids[row]
            for bucket, row in self.rows()
            if (bucket.streams[row], bucket.stamps[row], bucket.seqs[row]) in wanted
        ]

    def views(self) -> Iterator[Held]:
        """Each dozing timer as a ``Held`` built for reading (it keeps dozing)."""
        for bucket, row in self.rows():
            yield self._held(bucket, row)

    def _held(self, bucket: _Bucket, row: int) -> Held:
        start = bucket.ends[row - 1] if row else 0
        entry_id = f"{bucket.stamps[row]}-{bucket.seqs[row]}"
        return Held(
            bucket.ids[row],
            Entry(self.streams[bucket.streams[row]], entry_id, {}),
            None,
            bucket.labels[start : bucket.ends[row]].decode(),
            bucket.task_instances[row],
            bucket.tries[row],
            moment=_EPOCH + bucket.moments[row] * _US,
        )

    def _earliest(self) -> int | None:
        while self.starts and self.starts[0] not in self.by_bucket:
            heapq.heappop(self.starts)
        return self.starts[0] if self.starts else None

    def _unindex(self, i: int) -> None:
        self.buckets[i] = _GONE
        self.gone += 1
        if self.gone > len(self.ids) // 2:
            # In C (map, compress), not a Python step per trigger held.
            keep = list(map(_GONE.__ne__, self.buckets))
            self.ids = array("q", compress(self.ids, keep))
            self.buckets = array("q", compress(self.buckets, keep))
            self.gone = 0


class HeldTriggers(MutableMapping[int, Held]):
    """The triggers held, by id: a dict of ``Held``s and the far timers dozing. Asking for a
    dozing timer (``[]``, ``get``) wakes it: it becomes a ``Held`` on the timers' heap
    (``schedule``) and stays one. Iterating lists the ids without waking any."""

    def __init__(self) -> None:
        self.live: dict[int, Held] = {}
        self.far = FarTimers()
        # Puts a woken timer on the timers' heap (set by timers.Timers).
        self.schedule: Callable[[Held], None] | None = None

    def __getitem__(self, trigger_id: int) -> Held:
        held = self.get(trigger_id)
        if held is None:
            raise KeyError(trigger_id)
        return held

    def get(self, trigger_id: int, default: Held | None = None) -> Held | None:  # type: ignore[override]
        held = self.live.get(trigger_id)
        if held is None:
            held = self.far.pop(trigger_id)
            if held is None:
                return default
            self.live[trigger_id] = held
            if self.schedule is not None:
                self.schedule(held)
        return held

    def __setitem__(self, trigger_id: int, held: Held) -> None:
        self.far.pop(trigger_id)  # a dozing timer replaced
        self.live[trigger_id] = held

    def __delitem__(self, trigger_id: int) -> None:
        if self.live.pop(trigger_id, None) is None and self.far.pop(trigger_id) is None:
            raise KeyError(trigger_id)

    def __contains__(self, trigger_id: object) -> bool:
        if not isinstance(trigger_id, int):
            return False
        return trigger_id in self.live or self.far.holds(trigger_id)

    def __iter__(self) -> Iterator[int]:
        return iter([*self.live, *self.far.trigger_ids()])

    def __len__(self) -> int:
        return len(self.live) + len(self.far)

    def doze(self, held: Held) -> bool:
        """Keep the timer ``held`` in columns until its bucket wakes; False if it stays a
        ``Held`` (not held here, or not kept in columns)."""
        if self.live.get(held.trigger_id) is not held or not self.far.put(held):
            return False
        del self.live[held.trigger_id]
        return True

    def wake_due(self, now: dt.datetime, limit: int) -> list[Held]:
        """Up to ``limit`` dozing timers whose bucket's wake time has come, now ``Held``s."""
        woken = self.far.wake_due(now, limit)
        for held in woken:
            self.live[held.trigger_id] = held
        return woken

    def task_instances(self) -> tuple[list[int], list[int]]:
        """Every trigger id held and its task instance id, in two lists (nothing woken)."""
        trigger_ids, ti_ids = self.far.task_instances()
        trigger_ids += self.live
        ti_ids += [held.task_instance_id for held in self.live.values()]
        return trigger_ids, ti_ids

    def keyed(self, keys: Collection[tuple[str, str]]) -> dict[int, Held]:
        """The triggers held whose entry is one of ``keys``; dozing ones are woken."""
        found = {tid: held for tid, held in self.live.items() if held.key in keys}
        for trigger_id in self.far.keyed(keys):
            held = self.get(trigger_id)
            if held is not None:
                found[trigger_id] = held
        return found

    def timers(self) -> Iterator[Held]:
        """Every timer held (those dozing built for reading only, not woken)."""
        yield from (held for held in list(self.live.values()) if held.scope is None)
        yield from self.far.views()
