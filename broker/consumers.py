"""One consumer-group member of several streams: a worker serving several queues, a triggerer
serving several trigger queues.

A :class:`ConsumerSet` holds a :class:`StreamConsumer` per stream and offers the same calls,
routing each entry to the consumer of its stream (``Entry.stream``). No Redis command spans two
streams (each read, claim and Lua call names one stream and its index), so every stream may live
in its own Redis Cluster slot. Reads go round the streams, a different one first each time, so
a busy queue cannot starve a quiet one; when none has anything, the wait for new entries is
shared out among them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from broker.client import Broker
from broker.consumer import Delivery, Lost, StreamConsumer
from broker.replies import Entry


class ConsumerSet:
    def __init__(self, make: Callable[[str], StreamConsumer], streams: Sequence[str]) -> None:
        self._make = make
        # Replaced, never changed in place: the lease thread iterates it while streams join.
        self.consumers: dict[str, StreamConsumer] = {s: make(s) for s in dict.fromkeys(streams)}
        self._turn = 0

    @property
    def streams(self) -> list[str]:
        return list(self.consumers)

    def join(self, streams: Sequence[str]) -> list[str]:
        """Consume the ``streams`` not consumed yet too (their groups created first); those."""
        new = [s for s in dict.fromkeys(streams) if s not in self.consumers]
        for stream in new:
            consumer = self._make(stream)
            consumer.start()
            self.consumers = {**self.consumers, stream: consumer}
        return new

    def _of(self, entry: Entry) -> StreamConsumer:
        return self.consumers[entry.stream]

    def _in_turn(self) -> list[StreamConsumer]:
        consumers = list(self.consumers.values())
        self._turn = (self._turn + 1) % len(consumers)
        return consumers[self._turn :] + consumers[: self._turn]

    def start(self) -> None:
        for consumer in list(self.consumers.values()):
            consumer.start()

    @property
    def held(self) -> int:
        return sum(c.held for c in list(self.consumers.values()))

    def holds(self, entry: Entry) -> bool:
        """Whether ``entry`` is held: by its stream's consumer (an id alone may be held in
        another stream too)."""
        consumer = self.consumers.get(entry.stream)
        return consumer is not None and consumer.holds(entry.id)

    @property
    def replaying(self) -> bool:
        """Whether a stream's own pending entries are still being replayed (see
        :attr:`StreamConsumer.replaying`)."""
        return any(consumer.replaying for consumer in self.consumers.values())

    def poll(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` entries from the streams in turn (see :meth:`StreamConsumer.poll`)."""
        consumers = self._in_turn()
        if len(consumers) == 1:
            return consumers[0].poll(count, block_ms)
        got = _gather(consumers, count, lambda consumer, n: consumer.poll(n))
        if got or not block_ms:
            return got
        # Nothing anywhere: wait on one stream, a share of the time (the next call waits on the
        # next one). 0 would block for ever.
        return consumers[0].poll(count, max(1, block_ms // len(consumers)))

    def claim(self, count: int) -> list[Delivery]:
        return _gather(self._in_turn(), count, lambda consumer, n: consumer.claim(n))

    def starting(self, deliveries: Sequence[Delivery]) -> None:
        for stream, of_stream in _by_stream(deliveries, lambda d: d.entry).items():
            self.consumers[stream].starting(of_stream)

    def exhausted(self, delivery: Delivery) -> bool:
        return self._of(delivery.entry).exhausted(delivery)

    def exhausted_reason(self, delivery: Delivery) -> str:
        return self._of(delivery.entry).exhausted_reason(delivery)

    def dead_letter(self, delivery: Delivery, reason: str) -> bool:
        return self._of(delivery.entry).dead_letter(delivery, reason)

    def dead_letter_many(self, letters: Sequence[tuple[Delivery, str]]) -> bool:
        by_stream = _by_stream(letters, lambda letter: letter[0].entry).items()
        return all([self.consumers[stream].dead_letter_many(of) for stream, of in by_stream])

    def renew(self, via: Broker | None = None) -> list[Lost]:
        return [lost for c in list(self.consumers.values()) for lost in c.renew(via)]

    def hand_off(self) -> int:
        return sum(c.hand_off() for c in list(self.consumers.values()))

    def retire(self, entries: Sequence[Entry]) -> None:
        for stream, of_stream in _by_stream(entries, lambda e: e).items():
            self.consumers[stream].retire(of_stream)

    def release(self, entries: Sequence[Entry]) -> None:
        for stream, of_stream in _by_stream(entries, lambda e: e).items():
            if (consumer := self.consumers.get(stream)) is not None:
                consumer.release([entry.id for entry in of_stream])

    def hand_on_many(self, items: Sequence[tuple[Entry, str, Mapping[str, str]]]) -> None:
        for stream, of_stream in _by_stream(items, lambda item: item[0]).items():
            self.consumers[stream].hand_on_many(of_stream)


T = TypeVar("T")


def _gather(
    consumers: Sequence[StreamConsumer],
    count: int,
    take: Callable[[StreamConsumer, int], list[Delivery]],
) -> list[Delivery]:
    """Up to ``count`` deliveries, taken from the consumers in turn. When one fails (its Redis
    node is down) after others gave entries, those are returned, not dropped with the error:
    their consumers hold and renew them, so dropped they would never run (seen when a cluster
    primary died mid-read). The failing stream raises again at the next call."""
    got: list[Delivery] = []
    for consumer in consumers:
        if len(got) >= count:
            break
        try:
            got += take(consumer, count - len(got))
        except Exception:
            if not got:
                raise
            break
    return got


def _by_stream(items: Sequence[T], entry_of: Callable[[T], Entry]) -> dict[str, list[T]]:
    grouped: dict[str, list[T]] = {}
    for item in items:
        grouped.setdefault(entry_of(item).stream, []).append(item)
    return grouped
