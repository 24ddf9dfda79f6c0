"""What an asset watcher's source may send, against the real PostgreSQL: NUL and lone surrogates
are stored escaped, an event that still cannot be stored is recorded as a failure naming the
cause while the events after it are recorded, and a flood stops at the watcher's bound (counted
and logged once) until runs start."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from cryptography.fernet import Fernet
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.metrics import ASSET_WATCHER_BOUND_REACHED
from deferral.store.tables import AssetDagRunQueue, AssetEventRow
from deferral.triggers.base import TriggerEvent
from deferral.triggers.event import BaseEventTrigger
from tests.integration.test_assets import parse
from triggerer.watchers import Claimed, WatcherRunner

CONSUMER = """
from deferral import DAG
from deferral.assets import Asset
from deferral.operators import EmptyOperator

with DAG("on_orders", schedule=[Asset("orders")], max_active_runs=1):
    EmptyOperator(task_id="c")
"""
CLAIMED = Claimed(1, "orders", "w", "token")
WHERE = "asset watcher 'w' of asset 'orders'"


class ListTrigger(BaseEventTrigger):
    """Yields the payloads it was given, then ends; remembers what was acknowledged."""

    def __init__(self, payloads: list[dict[str, Any]]) -> None:
        super().__init__()
        self.payloads = payloads
        self.acknowledged: list[Any] = []

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.ListTrigger", {"payloads": self.payloads}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        for payload in self.payloads:
            yield TriggerEvent(payload)

    async def acknowledge(self, event: TriggerEvent) -> None:
        self.acknowledged.append(event.payload["key"])


def _runner(sessions: sessionmaker[Session], max_queued: int = 500) -> WatcherRunner:
    cipher = Cipher([Fernet.generate_key().decode()])
    return WatcherRunner(sessions, cipher, "t1", [__name__], 0.05, max_queued)


def _extras(sessions: sessionmaker[Session]) -> dict[str, Any]:
    with sessions() as session:
        rows = session.execute(select(AssetEventRow.dedup_key, AssetEventRow.extra))
        return {key: extra for key, extra in rows}


def test_nul_and_lone_surrogates_are_stored_escaped_and_an_unstorable_event_is_noted(
    sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    payloads: list[dict[str, Any]] = [
        {"key": "k0", "v": "plain"},
        {"key": "k1", "v": "a\x00b"},
        {"key": "k2", "v": ["\ud800", {"\udfff\x00": 1}]},
        {"key": "k3\x00"},
        {"key": "k4", "v": float("nan")},  # JSON PostgreSQL refuses whatever its text
        *({"key": f"after{n}"} for n in range(5)),
    ]
    trigger = ListTrigger(payloads)
    runner = _runner(sessions)
    anyio.run(runner._events, trigger, CLAIMED, WHERE)
    extras = _extras(sessions)
    assert extras["k1"] == {"v": "a\\x00b"}
    assert extras["k2"] == {"v": ["\\ud800", {"\\udfff\\x00": 1}]}
    assert extras["k3\\x00"] == {}
    assert "could not be recorded" in extras["k4"]["error"]
    assert all(f"after{n}" in extras for n in range(5))
    assert len(extras) == len(payloads) == runner.recorded
    assert trigger.acknowledged == [p["key"] for p in payloads]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and said[0].startswith(f"{WHERE}: entry k4 could not be recorded (")
    assert "\n" not in said[0] and "ExceptionGroup" not in said[0]


def test_a_failing_source_is_logged_by_its_own_error_not_the_task_groups(
    sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(ListTrigger):
        async def run(self) -> AsyncIterator[TriggerEvent]:
            yield TriggerEvent({"key": "first"})
            raise RuntimeError("the source went away")

    runner = _runner(sessions)

    async def main() -> None:
        with anyio.move_on_after(1):
            await runner._watch_trigger(Broken([]), CLAIMED, WHERE)

    anyio.run(main)
    failed = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    assert failed and set(failed) == {f"{WHERE} failed: RuntimeError: the source went away"}


def test_a_flood_stops_at_the_watchers_bound_and_reads_on_as_runs_start(
    sessions: sessionmaker[Session],
    settings: Settings,
    write_dag: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    write_dag("on_orders", CONSUMER)
    parse(sessions, settings, Cipher(settings.fernet_keys))
    trigger = ListTrigger([{"key": f"e{n}"} for n in range(1000)])
    runner = _runner(sessions, max_queued=100)
    reached_before = ASSET_WATCHER_BOUND_REACHED._value.get()

    def recorded() -> int:
        with sessions() as session:
            return int(session.scalar(select(func.count()).select_from(AssetEventRow)) or 0)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(runner._events, trigger, CLAIMED, WHERE)
            with anyio.fail_after(60):
                while ASSET_WATCHER_BOUND_REACHED._value.get() == reached_before:
                    await anyio.sleep(0.02)
                await anyio.sleep(0.3)  # six polls at the bound: nothing more is recorded
                assert recorded() == 100 and len(trigger.acknowledged) == 100
                with sessions.begin() as session:  # as if runs started for the queued events
                    session.execute(delete(AssetDagRunQueue))
                while recorded() < 200:
                    await anyio.sleep(0.02)
                await anyio.sleep(0.3)
                assert recorded() == 200 and len(trigger.acknowledged) == 200
            tasks.cancel_scope.cancel()

    anyio.run(main)
    # Reached twice, counted twice, said once: the second time falls within the minute.
    assert ASSET_WATCHER_BOUND_REACHED._value.get() == reached_before + 2
    paused = [r.getMessage() for r in caplog.records if "reading paused" in r.getMessage()]
    assert paused == [
        f"{WHERE}: 100 of its events wait for their runs (DEFERRAL_ASSET_WATCHER_MAX_QUEUED):"
        " reading paused until runs start"
    ]
