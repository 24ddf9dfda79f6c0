"""The service skeleton (``broker.service``): reading entries, spotting a poison, heartbeats and
"the batch, then one by one", as each of the three services uses them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.client import LeaseStatus
from broker.consumer import Delivery, Lost
from broker.consumers import ConsumerSet
from broker.replies import Entry
from broker.service import (
    Registration,
    batch_then_each,
    each_alone,
    hand_off,
    heartbeat,
    poisoned,
    read_each,
)
from broker.streams import MalformedEntry
from deferral.store import liveness

log = logging.getLogger("test")


def _delivery(entry_id: str, deliveries: int = 1) -> Delivery:
    return Delivery(Entry("s", entry_id, {b"n": entry_id.encode()}), deliveries)


def test_a_batch_that_applies_is_applied_once_together() -> None:
    calls: list[str] = []

    def together(items: Sequence[int]) -> int:
        calls.append("together")
        return sum(items)

    def alone(items: Sequence[int]) -> int:
        calls.append("alone")
        return 0

    assert batch_then_each([1, 2, 3], together, alone, doing="adding", logger=log) == 6
    assert calls == ["together"]


def test_a_batch_with_bad_data_is_applied_one_by_one_and_the_bad_one_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused: list[tuple[int, str]] = []

    def apply(item: int) -> int:
        if item == 2:
            raise ValueError("two is bad")
        return item * 10

    def together(items: Sequence[int]) -> list[int]:
        return [apply(item) for item in items]

    def alone(items: Sequence[int]) -> list[int]:
        return each_alone(items, apply, lambda item, exc: refused.append((item, str(exc))))

    with caplog.at_level(logging.ERROR, "test"):
        applied = batch_then_each([1, 2, 3], together, alone, doing="applying 3", logger=log)
    assert applied == [10, 30]
    assert refused == [(2, "two is bad")]
    assert "applying 3 together failed; one by one now" in caplog.text


def test_a_transient_error_is_raised_for_the_whole_batch_to_be_retried() -> None:
    def down(items: Sequence[int]) -> int:
        raise RedisConnectionError("down")

    with pytest.raises(RedisConnectionError):
        batch_then_each([1], down, down, doing="x", logger=log)
    with pytest.raises(RedisConnectionError):
        each_alone([1, 2], lambda item: down([item]), lambda item, exc: None)


def test_read_each_sets_aside_what_cannot_be_read_saying_why() -> None:
    def read(delivery: Delivery) -> int:
        n = int(delivery.entry.fields[b"n"].split(b"-")[0])
        if n == 2:
            raise MalformedEntry("no payload")
        if n == 3:
            raise RecursionError("deep")
        return n

    ok, bad = read_each([_delivery(f"{n}-0") for n in (1, 2, 3)], read, "event entry")
    assert [(d.entry.id, n) for d, n in ok] == [("1-0", 1)]
    assert [(d.entry.id, why) for d, why in bad] == [
        ("2-0", "bad event entry: no payload"),
        ("3-0", "unreadable event entry: RecursionError: deep"),
    ]


class _Consumer:
    """What the skeleton asks of a ConsumerSet."""

    def __init__(self, lost: list[Lost]) -> None:
        self.lost = lost

    def exhausted(self, delivery: Delivery) -> bool:
        return delivery.deliveries > 3

    def exhausted_reason(self, delivery: Delivery) -> str:
        return f"was delivered {delivery.deliveries} times"

    def renew(self) -> list[Lost]:
        return self.lost


def test_a_poison_is_named_with_how_often_it_was_delivered() -> None:
    consumer = cast(ConsumerSet, _Consumer([]))
    assert poisoned(consumer, _delivery("1-0", 3), "event e") is None
    assert poisoned(consumer, _delivery("1-0", 4), "event e") == "event e was delivered 4 times"


def test_a_heartbeat_renews_hands_on_the_lost_and_records_the_process() -> None:
    lost = [Lost("s", "1-0", LeaseStatus.GONE)]
    recorded: list[str] = []
    handed: list[list[Lost]] = []

    class _Registration:
        def record(self, state: str = liveness.RUNNING) -> None:
            recorded.append(state)

    registration = cast(Registration, _Registration())
    heartbeat(cast(ConsumerSet, _Consumer(lost)), registration, handed.append)
    heartbeat(cast(ConsumerSet, _Consumer([])), registration, handed.append)
    assert handed == [lost]
    assert recorded == [liveness.RUNNING, liveness.RUNNING]


def test_a_heartbeat_records_the_process_while_redis_fails() -> None:
    """Else every live process looks dead once Redis is back, and its work is taken over."""
    recorded: list[str] = []

    class _Down(_Consumer):
        def renew(self) -> list[Lost]:
            raise RedisConnectionError("refused")

    class _Registration:
        def record(self, state: str = liveness.RUNNING) -> None:
            recorded.append(state)

    with pytest.raises(RedisConnectionError):
        heartbeat(cast(ConsumerSet, _Down([])), cast(Registration, _Registration()))
    assert recorded == [liveness.RUNNING]


class _Leaving:
    """A ConsumerSet on the way out: it holds ``held`` entries, or Redis fails."""

    def __init__(self, held: int, fails: bool = False) -> None:
        self.held = held
        self.fails = fails

    def hand_off(self) -> int:
        if self.fails:
            raise RedisConnectionError("gone")
        return self.held


def test_a_process_on_its_way_out_hands_off_what_it_holds_or_says_it_could_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, "deferral.service"):
        hand_off(cast(ConsumerSet, _Leaving(3)), "event entr(ies)")
        hand_off(cast(ConsumerSet, _Leaving(0)), "event entr(ies)")  # nothing held: nothing said
        hand_off(cast(ConsumerSet, _Leaving(3, fails=True)), "event entr(ies)")
    assert [r.getMessage() for r in caplog.records] == [
        "handed off 3 event entr(ies)",
        "could not hand off event entr(ies): gone (peers take them after the delay)",
    ]
