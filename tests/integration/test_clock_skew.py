"""A triggerer whose host clock is 30 s ahead of PostgreSQL's fires no timer early: the offset
measured at its registration corrects its timers, the skew metric shows it, and its log says so
once."""

from __future__ import annotations

import datetime as dt
import logging

import anyio
import pytest
from prometheus_client import generate_latest
from sqlalchemy.orm import Session, sessionmaker

from broker.replies import Entry
from deferral.runtime import clock, metrics
from deferral.triggers import TimeDeltaTrigger
from triggerer.held import Held
from triggerer.timers import Timers

AHEAD = dt.timedelta(seconds=30)


def test_a_host_clock_ahead_fires_no_timer_early_and_the_metric_shows_it(
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(clock, "_host_ahead", AHEAD)  # what DEFERRAL_TEST_CLOCK_OFFSET_SEC sets
    monkeypatch.setattr(clock, "_correction", dt.timedelta(0))
    monkeypatch.setattr(clock, "_warned_at", None)
    with caplog.at_level(logging.WARNING, "deferral.clock"), sessions.begin() as session:
        assert clock.observe(session) == pytest.approx(30, abs=0.5)
        clock.observe(session)  # measured again at the next heartbeat: not said again
    assert [r.getMessage() for r in caplog.records] == [
        "this host's clock is 30.0 s ahead of PostgreSQL's: time triggers fire by PostgreSQL's"
        " clock; fix the host's time synchronisation (NTP)"
    ]
    scraped = generate_latest(metrics.registry_for(metrics.TRIGGERER)).decode()
    (line,) = [x for x in scraped.splitlines() if x.startswith("deferral_clock_skew_seconds ")]
    assert float(line.split()[1]) == pytest.approx(30, abs=0.5)

    # A timer due 0.2 s from now by the database's clock: by the host's it is long past.
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.2)
    assert clock.host_now() > moment
    held = Held(1, Entry("s", "1-0", {}), None, "d.r.t", 1, 1, moment=moment)
    fired_at: list[dt.datetime] = []

    async def main() -> None:
        timers = Timers()
        timers.add(held)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(timers.run, lambda _: fired_at.append(dt.datetime.now(dt.UTC)))
            with anyio.fail_after(10):
                while not fired_at:
                    await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    assert fired_at[0] >= moment
    # A delta counts from the database's time too, not from the host's.
    made = TimeDeltaTrigger(dt.timedelta(seconds=10)).moment
    assert abs((made - dt.datetime.now(dt.UTC)).total_seconds() - 10) < 1
