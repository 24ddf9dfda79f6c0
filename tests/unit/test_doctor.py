"""deferral.store.doctor: the stuck-deferred-task checklist's decisions, from counts and ages."""

from __future__ import annotations

import pytest

from deferral.store import doctor
from deferral.store.doctor import Check, Status


def test_a_line_is_status_two_spaces_check_colon_detail() -> None:
    assert Check(Status.WARN, "capacity", "too low").line() == "warn  capacity: too low"


@pytest.mark.parametrize(
    ("statuses", "code"),
    [
        ([], 0),
        ([Status.OK, Status.OK], 0),
        ([Status.OK, Status.WARN], 0),
        ([Status.WARN, Status.FAIL, Status.OK], 1),
    ],
)
def test_exit_code_is_1_only_when_a_check_fails(statuses: list[Status], code: int) -> None:
    assert doctor.exit_code(Check(s, "c", "d") for s in statuses) == code


# -- triggerer alive -------------------------------------------------------------------------------


def test_deferred_tasks_without_a_live_triggerer_fail_naming_the_stale_ones() -> None:
    check = doctor.triggerer_alive(3, [], [("old", 60.0), ("gone (stopped)", 600.0)], 10.5)
    assert check.status is Status.FAIL and check.name == "triggerer alive"
    assert "3 deferred tasks but no triggerer is alive (heartbeat within 10.5s)" in check.detail
    assert "old 60s ago, gone (stopped) 600s ago" in check.detail
    assert "triggerer consume" in check.detail


def test_no_triggerer_and_no_deferred_task_is_fine() -> None:
    check = doctor.triggerer_alive(0, [], [], 10.5)
    assert check.status is Status.OK and "no task is deferred" in check.detail


def test_a_live_triggerer_is_ok_and_named() -> None:
    check = doctor.triggerer_alive(5, ["t1"], [("old", 99.0)], 10.5)
    assert check == Check(Status.OK, "triggerer alive", "1 triggerer alive: t1")


def test_many_stale_triggerers_are_listed_newest_first_and_capped() -> None:
    stale = [(f"t{n}", float(n)) for n in range(9, 0, -1)]
    check = doctor.triggerer_alive(1, [], stale, 2.1)
    assert "t1 1s ago, t2 2s ago, t3 3s ago, t4 4s ago, t5 5s ago, and 4 more" in check.detail


# -- capacity --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("deferred", "capacity", "alive", "status"),
    [
        (0, 0, 0, Status.OK),
        (10, 10, 1, Status.OK),
        (11, 10, 1, Status.WARN),
        (1, 0, 0, Status.WARN),
    ],
)
def test_capacity_warns_when_alive_capacity_is_below_the_deferred_tasks(
    deferred: int, capacity: int, alive: int, status: Status
) -> None:
    check = doctor.capacity(deferred, capacity, alive)
    assert check.status is status and check.name == "capacity"
    assert f"capacity {capacity}" in check.detail


def test_capacity_detail_counts() -> None:
    check = doctor.capacity(1500, 1000, 1)
    assert check.detail.startswith("1500 deferred tasks, capacity 1000 on 1 alive triggerer:")


# -- expired timeouts ------------------------------------------------------------------------------


def test_expired_timeouts_fail_with_the_count_and_the_oldest() -> None:
    check = doctor.expired_timeouts(2, 75.4)
    assert check.status is Status.FAIL and check.name == "expired timeouts"
    assert "2 deferred tasks past trigger_timeout (oldest by 75s)" in check.detail
    assert "scheduler consume" in check.detail


def test_no_expired_timeout_is_ok() -> None:
    check = doctor.expired_timeouts(0, None)
    assert check.status is Status.OK and "more than 10s" in check.detail


# -- orphaned triggers -----------------------------------------------------------------------------


def test_triggers_nobody_waits_on_warn_with_their_ids() -> None:
    check = doctor.orphaned_triggers([4, 9], [])
    assert check.status is Status.WARN and check.name == "orphaned triggers"
    assert check.detail == "2 triggers no task waits on (id 4, 9)"


def test_deferred_tasks_without_a_trigger_row_fail() -> None:
    check = doctor.orphaned_triggers([4], ["d.r.t"])
    assert check.status is Status.FAIL
    assert "1 deferred task without a trigger row (d.r.t)" in check.detail
    assert "1 trigger no task waits on (id 4)" in check.detail


def test_no_orphan_is_ok() -> None:
    assert doctor.orphaned_triggers([], []).status is Status.OK


# -- unpublished outbox ----------------------------------------------------------------------------


def test_stale_outbox_rows_fail_with_the_count() -> None:
    check = doctor.unpublished_outbox(3, 42.0)
    assert check.status is Status.FAIL and check.name == "unpublished outbox"
    assert "3 outbox rows unpublished for more than 30s (oldest 42s)" in check.detail


def test_no_stale_outbox_row_is_ok() -> None:
    assert doctor.unpublished_outbox(0, None).status is Status.OK


# -- dead letters ----------------------------------------------------------------------------------


def test_dead_letters_warn_with_the_count_and_the_newest_error() -> None:
    check = doctor.dead_letters("p:dead", 2, "token failed authentication\ntraceback...")
    assert check == Check(
        Status.WARN,
        "dead letters",
        "2 entries in p:dead; newest error: token failed authentication",
    )


def test_one_dead_letter_without_an_error_field() -> None:
    check = doctor.dead_letters("p:dead", 1, None)
    assert check.detail == "1 entry in p:dead; newest error: (no error field)"


def test_a_long_error_is_cut() -> None:
    check = doctor.dead_letters("p:dead", 1, "x" * 1000)
    assert check.detail.endswith("x...") and len(check.detail) < 300


def test_an_empty_dead_letter_stream_is_ok() -> None:
    assert doctor.dead_letters("p:dead", 0, None) == Check(
        Status.OK, "dead letters", "p:dead is empty"
    )


# -- redis data ------------------------------------------------------------------------------------


def test_every_deferred_task_in_flight_is_ok() -> None:
    assert doctor.in_flight([]).status is Status.OK


def test_a_deferred_task_whose_trigger_is_in_no_stream_fails() -> None:
    check = doctor.in_flight(["d.r.a", "d.r.b"])
    assert check.status is Status.FAIL
    assert "2 deferred tasks whose trigger is in no stream (d.r.a, d.r.b)" in check.detail


def test_broken_dags_warn_within_their_grace_and_fail_after() -> None:
    within = doctor.BrokenDag("etl", 30, "SyntaxError: invalid syntax (line 3)\nmore", 2)
    check = doctor.broken_dags([within], grace_sec=300)
    assert check.status is Status.WARN
    assert "etl for 30s (SyntaxError: invalid syntax (line 3)): 2 running runs fail in 270s" in (
        check.detail
    )
    overdue = doctor.BrokenDag("etl", 400, "gone", 1)
    assert doctor.broken_dags([overdue], grace_sec=300).status is Status.FAIL
    assert doctor.broken_dags([], grace_sec=300).status is Status.OK


def test_import_errors_warn_naming_each_file_and_its_error() -> None:
    failing = [
        doctor.FailingFile("dags/a.py", "SyntaxError: invalid syntax (line 3)"),
        doctor.FailingFile("dags/b.py", "ModuleNotFoundError: No module named 'x' (line 1)"),
    ]
    check = doctor.import_errors(failing)
    assert check.status is Status.WARN
    assert check.detail == (
        "2 DAG files failing to import: dags/a.py (SyntaxError: invalid syntax (line 3)),"
        " dags/b.py (ModuleNotFoundError: No module named 'x' (line 1));"
        " `deferral dags list` shows each error"
    )
    assert doctor.import_errors([]).status is Status.OK
