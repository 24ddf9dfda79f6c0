"""Service processes register themselves, heartbeat, and stop cleanly on SIGTERM."""

from __future__ import annotations

import signal

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import Triggerer
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


def _triggerer(sessions: sessionmaker[Session], name: str) -> Triggerer | None:
    with sessions() as session:
        return session.scalars(select(Triggerer).where(Triggerer.name == name)).one_or_none()


def test_triggerer_heartbeats_in_postgres_and_every_service_exits_0_on_sigterm(
    services: Services, sessions: sessionmaker[Session]
) -> None:
    triggerer = services.start(
        "triggerer", "--name", "t-1", "--heartbeat", "0.2", "--capacity", "7"
    )
    scheduler = services.start("scheduler")
    worker = services.start("worker", "--concurrency", "1")

    first = wait_for(lambda: _triggerer(sessions, "t-1"), what="the triggerer row")
    assert (first.state, first.capacity, first.pid) == ("running", 7, triggerer.pid)
    wait_for(
        lambda: (
            (row := _triggerer(sessions, "t-1")) and row.latest_heartbeat > first.latest_heartbeat
        ),
        what="a later heartbeat",
    )
    services.wait_up("worker")
    services.wait_up("scheduler")

    for proc in (triggerer, scheduler, worker):
        proc.send_signal(signal.SIGTERM)
    for proc in (triggerer, scheduler, worker):
        assert proc.wait(timeout=30) == 0
    stopped = _triggerer(sessions, "t-1")
    assert stopped is not None and stopped.state == "stopped"
