"""The metrics module: the Operations page's table lists exactly what each service serves; the
streams collector reports what its source says and survives a source that fails; the watchdog
reports the loop's lag."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from deferral.runtime import metrics
from deferral.runtime.metrics import StreamsCollector
from deferral.runtime.outages import Outage
from triggerer.watchdog import LoopWatchdog

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _readme_rows() -> dict[str, str]:
    """metric name -> service column, from the table under "### Metrics"."""
    text = OPERATIONS.read_text()
    section = text[text.index("### Metrics") :]
    section = section[: section.index("\n### ", 1)]
    rows = re.findall(r"^\| `([a-z_]+)(?:\{[^}]*\})?` \| (\w+) \|", section, flags=re.MULTILINE)
    assert rows, "no metrics table under ### Metrics"
    return dict(rows)


def _column_covers(where: str, process: str) -> bool:
    return where in ("all", process) or (where == "services" and process in metrics.SERVICES)


@pytest.mark.parametrize("process", metrics.PROCESSES)
def test_the_readme_table_lists_exactly_what_each_process_serves(process: str) -> None:
    listed = {name for name, where in _readme_rows().items() if _column_covers(where, process)}
    assert listed == metrics.served_names(process)


def test_every_service_column_names_a_process() -> None:
    assert set(_readme_rows().values()) <= {"all", "services", *metrics.PROCESSES}


@pytest.mark.parametrize("process", metrics.PROCESSES)
def test_a_first_scrape_shows_every_known_label_value_at_0_and_none_has_a_space(
    process: str,
) -> None:
    shown = generate_latest(metrics.registry_for(process)).decode()
    for metric, values in metrics.KNOWN_LABELS.items():
        for value in values:
            assert " " not in value and value == value.lower()
            if process == metrics.TRIGGERER and metric is metrics.TRIGGERS_CANCELLED:
                # Shown from the start (at 0 in a fresh process; earlier tests here may count).
                series = f'deferral_triggers_cancelled_total{{reason="{value}"}} '
                assert series in shown
    assert 'deferral_build_info{python="' in shown
    label_values = re.findall(r'="([^"]*)"', shown)
    assert label_values and not [v for v in label_values if " " in v]


def test_the_triggerer_cancels_only_for_reasons_the_counter_knows() -> None:
    from triggerer import decide

    reasons = {decide.USER_ACTION, decide.TIMEOUT, decide.SUPERSEDED, "shutdown", "reassigned"}
    assert reasons == set(metrics.CANCEL_REASONS)


@dataclass(frozen=True)
class _Group:
    name: str
    pending: int
    lag: int | None


@dataclass(frozen=True)
class _Stream:
    stream: str
    length: int
    groups: tuple[_Group, ...]


def _scrape(collector: StreamsCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_streams_collector_reports_its_source() -> None:
    collector = StreamsCollector()
    assert "deferral_stream_length{" not in _scrape(collector)  # not connected yet
    collector.watch(
        lambda: [
            _Stream("p:triggers", 3, (_Group("triggerers", 2, 1),)),
            _Stream("p:dead", 1, ()),
        ]
    )
    shown = _scrape(collector)
    assert 'deferral_stream_length{stream="p:triggers"} 3.0' in shown
    assert 'deferral_stream_length{stream="p:dead"} 1.0' in shown
    assert 'deferral_stream_pending{group="triggerers",stream="p:triggers"} 2.0' in shown
    assert 'deferral_stream_lag{group="triggerers",stream="p:triggers"} 1.0' in shown


def test_streams_collector_answers_while_its_source_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    collector = StreamsCollector()

    def down() -> list[_Stream]:
        raise ConnectionError("Redis is down")

    collector.watch(down)
    assert "deferral_stream_length{" not in _scrape(collector)
    assert "could not read the streams for /metrics: Redis is down" in caplog.text


def test_watchdog_reports_the_loops_lag() -> None:
    lags: list[float] = []

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            watchdog: LoopWatchdog[str] = LoopWatchdog(
                10.0,
                lambda _task: None,
                lambda *_: None,
                lambda *_: None,
                0.02,
                on_lag=lags.append,
            )
            tasks.start_soon(watchdog.run)
            await anyio.sleep(0.1)
            time.sleep(0.3)  # holds the loop: the watchdog's sleep ends that much late
            await anyio.sleep(0.1)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    assert len(lags) >= 3
    assert all(lag >= 0 for lag in lags)
    assert max(lags) > 0.2


def test_a_server_failing_under_the_scrapes_is_said_once_by_the_outage_account(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A scrape every few seconds through an outage used to log a line each."""
    import redis

    collector = StreamsCollector()
    collector.outage = Outage(logging.getLogger("test.outage"), clock=lambda: 100.0)

    def down() -> list[_Stream]:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    collector.watch(down)
    for _ in range(5):
        assert "deferral_stream_length{" not in _scrape(collector)
    said = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert said == [
        "servers unavailable (ConnectionError: Error 111 connecting to 127.0.0.1:6379."
        " Connection refused.; reading the streams for /metrics); retrying"
    ]
    assert "could not read" not in caplog.text
