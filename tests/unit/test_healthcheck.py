"""deferral-healthcheck's verdict from a scrape of the service's metrics."""

from __future__ import annotations

import pytest

import deferral_healthcheck as probe

SCRAPE = """# HELP deferral_loop_iteration_timestamp_seconds Unix time of ...
# TYPE deferral_loop_iteration_timestamp_seconds gauge
deferral_loop_iteration_timestamp_seconds 1000.5
deferral_loop_iteration_timestamp_seconds_other 3.0
"""


@pytest.mark.parametrize(
    ("now", "why"),
    [
        (1001.0, None),
        (1030.5, None),
        (1031.0, "its main loop last completed an iteration 30s ago (over 30s)"),
    ],
)
def test_healthy_while_the_loop_iterated_recently(now: float, why: str | None) -> None:
    assert probe.verdict(SCRAPE, now, max_age_sec=30) == why


def test_a_loop_that_never_iterated_is_unhealthy() -> None:
    never = "deferral_loop_iteration_timestamp_seconds 0.0\n"
    assert probe.verdict(never, 5.0, 30) == "its main loop has not completed an iteration yet"
    assert probe.verdict("", 5.0, 30) == "its main loop has not completed an iteration yet"


def test_no_answer_is_unhealthy_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe.main(["--metrics-port", "1", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("unhealthy: no answer at http://127.0.0.1:1/metrics: ")
    assert err.count("\n") == 1
