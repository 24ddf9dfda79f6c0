"""health_checks: a process is healthy when its servers answer and its row heartbeats."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral.store.doctor import Status
from deferral_cli import health_checks

NOW = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.UTC)


def _ago(seconds: float) -> dt.datetime:
    return NOW - dt.timedelta(seconds=seconds)


def test_a_server_that_answers_is_ok_and_one_that_does_not_fails_saying_where() -> None:
    assert health_checks.server("redis", "redis:6379/0", None).line() == (
        "ok  redis: answers at redis:6379/0"
    )
    failed = health_checks.server("postgres", "db:5432/deferral", "connection refused")
    assert failed.status is Status.FAIL
    assert failed.line() == "fail  postgres: no answer at db:5432/deferral: connection refused"


def test_a_running_process_with_a_fresh_heartbeat_is_healthy() -> None:
    check = health_checks.heartbeat(
        "worker", "worker-1", health_checks.Beat("running", _ago(4)), NOW, 5
    )
    assert check.status is Status.OK
    assert check.line() == "ok  worker worker-1: running, heartbeat 4.0s ago"


def test_the_heartbeat_is_fresh_up_to_2_1_heartbeats_as_for_every_liveness_check() -> None:
    beat = health_checks.Beat("running", _ago(10.5))
    assert health_checks.heartbeat("triggerer", "t-1", beat, NOW, 5).status is Status.OK
    late = health_checks.heartbeat(
        "triggerer", "t-1", health_checks.Beat("running", _ago(10.6)), NOW, 5
    )
    assert late.status is Status.FAIL
    assert "heartbeat 10.6s ago, older than 10.5s (2.1 x DEFERRAL_HEARTBEAT_SEC=5)" in late.detail


def test_a_stopped_process_is_unhealthy_whatever_its_heartbeat() -> None:
    check = health_checks.heartbeat(
        "scheduler", "s-1", health_checks.Beat("stopped", _ago(1)), NOW, 5
    )
    assert check.status is Status.FAIL
    assert check.line() == "fail  scheduler s-1: stopped (heartbeat 1.0s ago)"


def test_a_process_without_a_row_is_unhealthy_and_the_name_is_suspected() -> None:
    check = health_checks.heartbeat("worker", "worker-9", None, NOW, 5)
    assert check.status is Status.FAIL
    assert "worker worker-9: no heartbeat recorded" in check.line()
    assert "another --name" in check.detail


def test_every_process_kind_that_heartbeats_can_be_checked() -> None:
    assert sorted(health_checks.PROCESSES) == ["scheduler", "triggerer", "worker"]


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:8080/api/v1/health"),
        ("::", "http://[::1]:8080/api/v1/health"),
        ("10.1.2.3", "http://10.1.2.3:8080/api/v1/health"),
        ("127.0.0.1", "http://127.0.0.1:8080/api/v1/health"),
    ],
)
def test_the_web_ui_is_asked_on_the_address_it_listens_on(host: str, url: str) -> None:
    assert health_checks.webserver_url(host, 8080) == url
    assert health_checks.webserver(url, None).line() == f"ok  webserver: answers at {url}"
    refused = health_checks.webserver(url, "Connection refused")
    assert refused.line() == f"fail  webserver: no answer at {url}: Connection refused"
