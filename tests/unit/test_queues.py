"""Queues of triggerers and workers: ``--queues`` lists, who serves a queue, doctor's check,
the triggers stream of each queue, and one consumer over several streams."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pytest
from click.testing import CliRunner

from broker.consumer import Delivery, Lost
from broker.consumers import ConsumerSet
from broker.replies import Entry
from broker.streams import StreamKeys
from deferral.store.doctor import Status
from deferral.store.queues import (
    MAX_QUEUES_TEXT,
    Waiting,
    parse_queues,
    queues_served,
    recorded,
    serves,
    unserved,
)
from triggerer.cli import main as triggerer_main
from worker.cli import main as worker_main


def test_a_queues_list_is_split_trimmed_and_deduplicated_in_order() -> None:
    assert parse_queues("gpu") == ("gpu",)
    assert parse_queues(" b , a,b ") == ("b", "a")


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("", "not a comma-separated list"),
        ("a,,b", "not a comma-separated list"),
        ("a,", "not a comma-separated list"),
        ("gpu,bad queue!", "queue 'bad queue!' is invalid"),
        (",".join(f"q{i:03d}" for i in range(80)), f"at most {MAX_QUEUES_TEXT}"),
    ],
)
def test_a_bad_queues_list_is_refused_naming_the_fault(text: str, fault: str) -> None:
    with pytest.raises(ValueError, match=fault):
        parse_queues(text)


@pytest.mark.parametrize("main", [worker_main, triggerer_main])
def test_consume_refuses_a_bad_queues_list_in_one_line(main: object) -> None:
    result = CliRunner().invoke(main, ["consume", "--queues", "a,,b"])  # type: ignore[arg-type]
    assert result.exit_code == 2
    assert "--queues" in result.output and "not a comma-separated list" in result.output


def test_who_serves_a_queue() -> None:
    assert recorded(None) is None and recorded(("a", "b")) == "a,b"
    assert serves(None, "gpu")  # every queue
    assert serves("default,gpu", "gpu") and not serves("default,gpu2", "gpu")
    assert unserved("gpu", []) and unserved("gpu", ["default"])
    assert not unserved("gpu", ["default", None])


def test_doctor_names_the_triggers_no_live_triggerer_serves() -> None:
    assert queues_served([]).status is Status.OK
    check = queues_served(
        [
            Waiting("gpu", 7, ["trigger 3 (d.r.t)", "trigger 4 (d.r.u)"]),
            Waiting("tpu", 1, ["trigger 9 (e.r.t)"]),
        ]
    )
    assert check.status is Status.FAIL
    assert check.detail == (
        "no live triggerer serves queue 'gpu': trigger 3 (d.r.t), trigger 4 (d.r.u) and 5 more;"
        " queue 'tpu': trigger 9 (e.r.t): start `triggerer consume --queues gpu,tpu`"
        " (or one without --queues)"
    )


def test_each_task_queue_has_a_triggers_stream_the_default_one_keeping_its_key() -> None:
    keys = StreamKeys("p")
    assert keys.triggers_for("default") == keys.triggers == "p:triggers"
    assert keys.triggers_for("gpu") == "p:triggers:gpu"
    assert keys.is_triggers("p:triggers") and keys.is_triggers("p:triggers:gpu")
    assert not keys.is_triggers("p:triggersx") and not keys.is_triggers("p:queue:gpu")
    fields = {"trigger_id": "5", "task_instance_id": "6"}
    assert keys.index_field("p:triggers:gpu", fields) == "5"
    assert keys.inflight("p:triggers:gpu") == "p:inflight:triggers:gpu"


class FakeConsumer:
    """What a ConsumerSet asks of a StreamConsumer, recorded."""

    def __init__(self, stream: str, ready: int = 0) -> None:
        self.stream = stream
        self.ready = [Entry(stream, f"{i}-0", {b"f": b"v"}) for i in range(1, ready + 1)]
        self.polls: list[tuple[int, int | None]] = []
        self.retired: list[str] = []
        self.released: list[str] = []
        self.started = 0
        self.mine: set[str] = set()

    def start(self) -> None:
        self.started += 1

    def poll(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        self.polls.append((count, block_ms))
        taken, self.ready = self.ready[:count], self.ready[count:]
        self.mine |= {e.id for e in taken}
        return [Delivery(e, 1) for e in taken]

    def holds(self, entry_id: str) -> bool:
        return entry_id in self.mine

    def retire(self, entries: Sequence[Entry]) -> None:
        self.retired += [e.id for e in entries]

    def release(self, entry_ids: Sequence[str]) -> None:
        self.released += entry_ids

    def renew(self, via: object = None) -> list[Lost]:
        return []


def _set(consumers: dict[str, FakeConsumer]) -> ConsumerSet:
    return ConsumerSet(consumers.__getitem__, list(consumers))  # type: ignore[arg-type]


def test_a_consumer_set_reads_its_streams_in_turn_and_routes_each_entry_to_its_own() -> None:
    fakes = {"a": FakeConsumer("a", ready=3), "b": FakeConsumer("b", ready=3)}
    both = _set(fakes)
    first = both.poll(4, 1000)
    assert len(first) == 4 and {d.entry.stream for d in first} == {"a", "b"}
    both.retire([d.entry for d in first])
    assert sorted(fakes["a"].retired + fakes["b"].retired) == sorted(d.entry.id for d in first)
    assert all(fakes[d.entry.stream].retired.count(d.entry.id) == 1 for d in first)
    rest = both.poll(10, 1000)
    assert len(rest) == 2 and all(block is None for _, block in fakes["a"].polls)


class DownConsumer(FakeConsumer):
    """A stream whose Redis node is down."""

    def poll(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        raise ConnectionError("Error 111 connecting: Connection refused")


def test_entries_read_before_another_stream_fails_are_returned_not_dropped() -> None:
    # Dropped with the error, they would be held and renewed by their consumer, never run.
    fakes = {"a": FakeConsumer("a", ready=2), "b": DownConsumer("b"), "c": FakeConsumer("c", 2)}
    every = _set(fakes)
    got: list[Delivery] = []
    for _ in range(3):  # each stream first once
        with contextlib.suppress(ConnectionError):
            got += every.poll(10, 1000)
    assert sorted(d.entry.stream for d in got) == ["a", "a", "c", "c"]
    with pytest.raises(ConnectionError):  # nothing else to return: the failure is said
        every.poll(10, 1000)


def test_a_consumer_set_with_nothing_to_read_waits_on_one_stream_a_share_of_the_time() -> None:
    fakes = {"a": FakeConsumer("a"), "b": FakeConsumer("b")}
    both = _set(fakes)
    assert both.poll(5, 1000) == []
    blocking = [block for f in fakes.values() for _, block in f.polls if block]
    assert blocking == [500]


def test_a_consumer_set_with_one_stream_is_that_stream_s_consumer() -> None:
    fakes = {"a": FakeConsumer("a", ready=1)}
    assert len(_set(fakes).poll(5, 1000)) == 1
    assert fakes["a"].polls == [(5, 1000)]


def test_a_consumer_set_joins_new_streams_started() -> None:
    fakes = {"a": FakeConsumer("a"), "b": FakeConsumer("b")}
    some = ConsumerSet(fakes.__getitem__, ["a"])  # type: ignore[arg-type]
    assert some.join(["a", "b"]) == ["b"] and some.streams == ["a", "b"]
    assert fakes["b"].started == 1 and fakes["a"].started == 0
    fakes["b"].mine.add("1-0")
    some.release([Entry("b", "1-0", {})])
    assert fakes["b"].released == ["1-0"] and fakes["a"].released == []


def test_an_entry_id_held_in_two_streams_is_released_and_found_in_its_own_only() -> None:
    """Shard streams filled in one millisecond repeat entry ids: an id names an entry only with
    its stream (releasing by id alone let go of another stream's entry too)."""
    fakes = {"a": FakeConsumer("a", ready=1), "b": FakeConsumer("b", ready=1)}
    both = _set(fakes)
    assert sorted(d.entry.key for d in both.poll(2)) == [("a", "1-0"), ("b", "1-0")]
    both.release([Entry("a", "1-0", {})])
    assert fakes["a"].released == ["1-0"] and fakes["b"].released == []
    assert both.holds(Entry("b", "1-0", {})) and not both.holds(Entry("c", "1-0", {}))
