"""Sensors as Airflow 2.x's own tests expect them: resumed deferrals, soft_fail, backoff,
duration arguments, poking before deferring, FileSensor's globs and directories, time zones."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import anyio
import pytest

from deferral import DAG
from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.exceptions import (
    DagDefinitionError,
    FailTask,
    RescheduleTask,
    SensorTimeout,
    SkipTask,
    TaskDeferralError,
    TaskDeferralTimeout,
    TaskDeferred,
    TaskExecutionTimeout,
    deferral_failure,
)
from deferral.sensors import (
    BaseSensorOperator,
    DateTimeSensor,
    DateTimeSensorAsync,
    FileSensor,
    PokeReturnValue,
    TimeDeltaSensorAsync,
)
from deferral.states import FAIL_METHOD
from deferral.triggers import FileTrigger, TriggerEvent
from deferral.triggers import file as file_trigger
from deferral.triggers.file import find_file
from tests.unit.test_operators import FUTURE, make_context
from tests.unit.test_triggers import collect

TIMED_OUT = {"error": "timeout"}
TRIGGER_FAILED = {"error": "trigger_failure", "message": "run() raised ValueError: gone"}


class Scripted(BaseSensorOperator):
    """A sensor whose poke returns (or raises) the given results in turn, then the last one."""

    def __init__(self, *, results: list[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.results = results
        self.pokes = 0

    def poke(self, context: Context) -> bool | PokeReturnValue:
        result = self.results[min(self.pokes, len(self.results) - 1)]
        self.pokes += 1
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    def execute(self, context: Context) -> Any:
        if self.deferrable:
            return self.poke_then_defer(context, lambda: FileTrigger("/never/there"))
        return super().execute(context)


def scripted(*results: Any, **kwargs: Any) -> Scripted:
    kwargs.setdefault("poke_interval", 0)
    kwargs.setdefault("deferrable", False)
    return Scripted(task_id="s", results=list(results), **kwargs)


# -- a deferral that ended without an event ------------------------------------------------------


def test_deferral_failure_timeout_and_trigger_failure() -> None:
    timed_out = deferral_failure(TIMED_OUT)
    assert isinstance(timed_out, TaskDeferralTimeout)
    assert "timed out" in str(timed_out)
    failed = deferral_failure({**TRIGGER_FAILED, "traceback": "Traceback ...\nValueError"})
    assert isinstance(failed, TaskDeferralError)
    assert str(failed) == "run() raised ValueError: gone\nTraceback ...\nValueError"
    assert str(deferral_failure({})) == "trigger failed"
    assert str(deferral_failure({"message": "", "traceback": ""})) == "trigger failed"


class Resumable(BaseOperator):
    def resume(self, context: Context, event: Any = None, **kwargs: Any) -> Any:
        return event, kwargs


def test_base_operator_resume_execution_calls_the_method_with_event_and_kwargs() -> None:
    op = Resumable(task_id="r")
    assert op.resume_execution("resume", {"event": 1, "n": 2}, make_context(op)) == (1, {"n": 2})
    assert op.resume_execution("resume", None, make_context(op)) == (None, {})


@pytest.mark.parametrize(
    ("next_kwargs", "raised"),
    [(TIMED_OUT, TaskDeferralTimeout), (TRIGGER_FAILED, TaskDeferralError)],
)
def test_base_operator_resume_execution_at_fail_raises(
    next_kwargs: dict[str, Any], raised: type[Exception]
) -> None:
    op = Resumable(task_id="r")
    with pytest.raises(raised):
        op.resume_execution(FAIL_METHOD, next_kwargs, make_context(op))


def test_sensor_whose_deferral_timed_out_fails_with_sensor_timeout() -> None:
    sensor = scripted(False, deferrable=True)
    with pytest.raises(SensorTimeout, match="'s' timed out: the deferral timed out"):
        sensor.resume_execution(FAIL_METHOD, TIMED_OUT, make_context(sensor))


def test_sensor_whose_deferral_timed_out_is_skipped_with_soft_fail() -> None:
    sensor = scripted(False, deferrable=True, soft_fail=True)
    with pytest.raises(SkipTask, match="timed out"):
        sensor.resume_execution(FAIL_METHOD, TIMED_OUT, make_context(sensor))


def test_sensor_whose_trigger_failed_raises_it_or_skips_with_soft_fail() -> None:
    sensor = scripted(False, deferrable=True)
    with pytest.raises(TaskDeferralError, match="gone"):
        sensor.resume_execution(FAIL_METHOD, TRIGGER_FAILED, make_context(sensor))
    soft = scripted(False, deferrable=True, soft_fail=True)
    with pytest.raises(SkipTask, match="TaskDeferralError: run"):
        soft.resume_execution(FAIL_METHOD, TRIGGER_FAILED, make_context(soft))


class CompletesBadly(Scripted):
    def execute_complete(self, context: Context, event: Any = None) -> None:
        if event == "defer again":
            self.defer(trigger=FileTrigger("/x"), method_name="execute_complete")
        if event == "fail":
            raise FailTask("the file was empty")
        raise ValueError("a bug")


def test_sensor_resume_soft_fail_skips_fail_task_but_not_bugs_nor_deferrals() -> None:
    sensor = CompletesBadly(task_id="c", results=[False], soft_fail=True, deferrable=True)
    context = make_context(sensor)
    with pytest.raises(SkipTask, match="FailTask: the file was empty"):
        sensor.resume_execution("execute_complete", {"event": "fail"}, context)
    with pytest.raises(ValueError, match="a bug"):
        sensor.resume_execution("execute_complete", {"event": "bug"}, context)
    with pytest.raises(TaskDeferred):
        sensor.resume_execution("execute_complete", {"event": "defer again"}, context)


# -- soft_fail, silent_fail, never_fail inside poke ----------------------------------------------


@pytest.mark.parametrize(
    "raised",
    [FailTask("no"), SensorTimeout("too late"), TaskExecutionTimeout("execution_timeout passed")],
)
@pytest.mark.parametrize("mode", ["poke", "reschedule"])
def test_soft_fail_skips_on_failures_raised_in_poke(raised: Exception, mode: str) -> None:
    sensor = scripted(raised, soft_fail=True, mode=mode)
    with pytest.raises(SkipTask, match=f"soft_fail.*{type(raised).__name__}"):
        sensor.execute(make_context(sensor))
    hard = scripted(raised, mode=mode)
    with pytest.raises(type(raised)):
        hard.execute(make_context(hard))


def test_soft_fail_skips_on_a_failure_in_the_poke_before_deferring() -> None:
    sensor = scripted(FailTask("no"), soft_fail=True, deferrable=True)
    with pytest.raises(SkipTask):
        sensor.execute(make_context(sensor))


def test_soft_fail_does_not_swallow_other_errors() -> None:
    """Airflow 2.10: soft_fail skips on sensor failures, not on bugs (never_fail does)."""
    sensor = scripted(KeyError("bug"), soft_fail=True)
    with pytest.raises(KeyError):
        sensor.execute(make_context(sensor))


def test_skip_raised_in_poke_skips_as_is() -> None:
    sensor = scripted(SkipTask("nothing today"))
    with pytest.raises(SkipTask, match="nothing today"):
        sensor.execute(make_context(sensor))


def test_never_fail_skips_on_any_error() -> None:
    sensor = scripted(KeyError("bug"), never_fail=True)
    with pytest.raises(SkipTask, match=r"never_fail.*KeyError"):
        sensor.execute(make_context(sensor))


def test_silent_fail_pokes_again_after_an_error() -> None:
    sensor = scripted(KeyError("flaky"), RuntimeError("flaky again"), True, silent_fail=True)
    assert sensor.execute(make_context(sensor)) is None
    assert sensor.pokes == 3


def test_soft_fail_and_never_fail_exclude_each_other() -> None:
    with pytest.raises(DagDefinitionError, match="'s': soft_fail and never_fail"):
        scripted(True, soft_fail=True, never_fail=True)


def test_poke_return_value_is_the_sensors_return_value() -> None:
    sensor = scripted(False, PokeReturnValue(True, xcom_value={"rows": 3}))
    assert sensor.execute(make_context(sensor)) == {"rows": 3}
    assert not PokeReturnValue(False)


# -- exponential backoff -----------------------------------------------------------------------


def test_backoff_doubles_with_jitter_and_is_deterministic() -> None:
    sensor = scripted(False, poke_interval=10, exponential_backoff=True, timeout=10**6)
    for n in range(1, 8):
        base = max(int(10 * 2 ** (n - 2)), 1)
        delay = sensor._next_poke_interval(123.0, 0, n)
        assert base <= delay < 2 * base
        assert delay == sensor._next_poke_interval(123.0, 0, n)


def test_backoff_never_passes_max_wait_nor_the_time_left() -> None:
    capped = scripted(False, poke_interval=10, exponential_backoff=True, max_wait=30)
    assert capped.max_wait == dt.timedelta(seconds=30)
    assert capped._next_poke_interval(1.0, 0, 10) == 30
    near_timeout = scripted(False, poke_interval=10, exponential_backoff=True, timeout=100)
    assert near_timeout._next_poke_interval(1.0, 95.5, 10) == 5


def test_without_backoff_the_delay_is_the_poke_interval() -> None:
    sensor = scripted(False, poke_interval=dt.timedelta(minutes=2))
    assert sensor._next_poke_interval(1.0, 5000, 9) == 120


def _reschedule_delay(sensor: BaseSensorOperator, waited: dt.timedelta) -> float:
    before = dt.datetime.now(dt.UTC)
    first_poke = before - waited
    with pytest.raises(RescheduleTask) as info:
        sensor.execute(make_context(sensor, first_started_at=first_poke))
    return (info.value.reschedule_date - before).total_seconds()


def test_exponential_backoff_grows_the_delay_in_reschedule_mode() -> None:
    """Each poke is a new run of the task: the delay grows with the time waited so far."""
    sensor = scripted(
        False, mode="reschedule", poke_interval=60, exponential_backoff=True, timeout=10**6
    )
    early = _reschedule_delay(sensor, dt.timedelta(seconds=1))
    later = _reschedule_delay(sensor, dt.timedelta(minutes=30))
    much_later = _reschedule_delay(sensor, dt.timedelta(hours=10))
    assert 30 <= early < 60 + 1
    assert later > early
    assert much_later > 2 * later
    plain = scripted(False, mode="reschedule", poke_interval=60)
    assert 59 <= _reschedule_delay(plain, dt.timedelta(hours=10)) <= 61


def test_reschedule_backoff_is_capped_by_max_wait() -> None:
    sensor = scripted(
        False, mode="reschedule", poke_interval=60, exponential_backoff=True, max_wait=90
    )
    assert _reschedule_delay(sensor, dt.timedelta(hours=10)) <= 91


# -- duration arguments ---------------------------------------------------------------------------


def test_durations_accept_timedelta_and_numbers() -> None:
    sensor = scripted(
        True,
        poke_interval=dt.timedelta(seconds=90),
        timeout=dt.timedelta(hours=1),
        max_wait=dt.timedelta(minutes=5),
    )
    assert (sensor.poke_interval, sensor.timeout) == (90.0, 3600.0)
    assert sensor.max_wait == dt.timedelta(minutes=5)
    numeric = scripted(True, poke_interval=2.5, timeout=7, max_wait=0)
    assert (numeric.poke_interval, numeric.timeout) == (2.5, 7.0)
    assert numeric.max_wait == dt.timedelta(0)
    assert scripted(True).max_wait is None


@pytest.mark.parametrize("name", ["poke_interval", "timeout", "max_wait"])
@pytest.mark.parametrize("bad", [-1, -0.5, dt.timedelta(seconds=-3)])
def test_negative_durations_are_refused_naming_the_argument(name: str, bad: Any) -> None:
    with pytest.raises(DagDefinitionError, match=f"task 's': {name} must not be negative"):
        scripted(True, **{name: bad})


@pytest.mark.parametrize("name", ["poke_interval", "timeout", "max_wait"])
@pytest.mark.parametrize("bad", ["60", True, [1]])
def test_durations_of_the_wrong_type_are_refused_naming_the_argument(name: str, bad: Any) -> None:
    with pytest.raises(DagDefinitionError, match=f"task 's': {name} must be a timedelta or a"):
        scripted(True, **{name: bad})


def test_deferral_timeout_is_the_sensor_timeout() -> None:
    sensor = scripted(False, deferrable=True, timeout=dt.timedelta(minutes=3))
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(make_context(sensor))
    assert info.value.timeout == dt.timedelta(minutes=3)
    assert info.value.method_name == "execute_complete"


# -- deferrable sensors poke once before deferring ------------------------------------------------


def test_deferrable_sensor_already_satisfied_returns_without_deferring() -> None:
    sensor = scripted(PokeReturnValue(True, "ready"), deferrable=True)
    assert sensor.execute(make_context(sensor)) == "ready"
    assert sensor.pokes == 1


def test_deferrable_sensor_not_satisfied_pokes_once_then_defers() -> None:
    sensor = scripted(False, deferrable=True)
    with pytest.raises(TaskDeferred):
        sensor.execute(make_context(sensor))
    assert sensor.pokes == 1


def test_datetime_sensor_async_in_the_past_returns_at_once() -> None:
    sensor = DateTimeSensorAsync(task_id="s", target_time=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    assert sensor.execute(make_context(sensor)) is None


def test_time_delta_sensor_async_passed_returns_and_pending_defers() -> None:
    sensor = TimeDeltaSensorAsync(task_id="s", delta=dt.timedelta(minutes=1))
    assert sensor.execute(make_context(sensor)) is None  # logical date in 2024
    with pytest.raises(TaskDeferred):
        sensor.execute(make_context(sensor, FUTURE))


def test_deferrable_file_sensor_with_the_file_present_returns_at_once(tmp_path: Path) -> None:
    (tmp_path / "flag").write_text("x")
    sensor = FileSensor(task_id="f", filepath=str(tmp_path / "flag"), deferrable=True)
    assert sensor.execute(make_context(sensor)) is None


def test_deferrable_file_sensor_refuses_a_zero_poke_interval() -> None:
    with pytest.raises(DagDefinitionError, match="'f': poke_interval must be greater than 0"):
        FileSensor(task_id="f", filepath="/x", deferrable=True, poke_interval=0)


# -- FileSensor / FileTrigger: globs and directories ---------------------------------------------


def test_find_file_plain_path_glob_and_directory_rules(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert find_file(str(data)) is None
    (data / "empty" / "deeper").mkdir(parents=True)
    assert find_file(str(data)) is None  # directories without a file do not count
    assert find_file(str(data / "*")) is None
    (data / "part-1.csv").write_text("")
    assert find_file(str(data / "part-*.csv")) == str(data / "part-1.csv")
    assert find_file(str(data)) == str(data / "part-1.csv")
    assert find_file(str(data / "*.json")) is None


def test_find_file_a_matching_directory_counts_by_a_file_at_any_depth(tmp_path: Path) -> None:
    nested = tmp_path / "day=2024-01-01" / "hour=00"
    nested.mkdir(parents=True)
    assert find_file(str(tmp_path / "day=*")) is None
    (nested / "_SUCCESS").write_text("")
    assert find_file(str(tmp_path / "day=*")) == str(nested / "_SUCCESS")


def test_find_file_recursive_double_star(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x.done").write_text("")
    pattern = str(tmp_path / "**" / "*.done")
    assert find_file(pattern, recursive=True) == str(deep / "x.done")
    # Without recursive, ** is a plain * (one directory level), as in glob.glob.
    assert find_file(pattern) is None


def test_file_sensor_poke_uses_globs_and_directory_rules(tmp_path: Path) -> None:
    sensor = FileSensor(
        task_id="f", filepath=str(tmp_path / "**" / "*.ok"), recursive=True, deferrable=False
    )
    assert sensor.poke(make_context(sensor)) is False
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "z.ok").write_text("")
    assert sensor.poke(make_context(sensor)) is True
    folder = FileSensor(task_id="d", filepath=str(tmp_path / "x"), deferrable=False)
    assert folder.poke(make_context(folder)) is True


def test_deferrable_file_sensor_hands_glob_and_recursive_to_the_trigger(tmp_path: Path) -> None:
    pattern = str(tmp_path / "**" / "*.ok")
    sensor = FileSensor(
        task_id="f", filepath=pattern, recursive=True, poke_interval=3, deferrable=True
    )
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(make_context(sensor))
    assert info.value.trigger.serialize()[1] == {
        "filepath": pattern,
        "poll_interval": 3.0,
        "recursive": True,
    }


def test_file_trigger_fires_on_a_glob_match_found_later(tmp_path: Path) -> None:
    trigger = FileTrigger(str(tmp_path / "in" / "*.csv"), poll_interval=0.01)

    async def scenario() -> list[TriggerEvent]:
        events: list[TriggerEvent] = []

        async def run() -> None:
            events.extend(await collect(trigger))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.05)
            (tmp_path / "in").mkdir()
            await anyio.sleep(0.05)
            assert events == []  # an empty directory is not a match
            (tmp_path / "in" / "a.csv").write_text("")
        return events

    assert anyio.run(scenario) == [TriggerEvent({"found": True})]  # no path in it


def test_file_trigger_touches_the_file_system_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[threading.Thread] = []

    def spy(filepath: str, recursive: bool = False) -> str | None:
        threads.append(threading.current_thread())
        return filepath

    monkeypatch.setattr(file_trigger, "find_file", spy)
    anyio.run(collect, FileTrigger(str(tmp_path), poll_interval=1))
    assert threads and all(t is not threading.main_thread() for t in threads)


def test_file_trigger_accepts_airflows_poke_interval_name() -> None:
    assert FileTrigger("/x", poke_interval=2).serialize()[1]["poll_interval"] == 2
    with pytest.raises(TypeError, match="not both"):
        FileTrigger("/x", poll_interval=1, poke_interval=2)
    with pytest.raises(TypeError, match="recursive must be a bool"):
        FileTrigger("/x", recursive="yes")  # type: ignore[arg-type]


# -- time zones ------------------------------------------------------------------------------------


def test_datetime_sensor_iso_string_target_naive_read_in_default_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "America/New_York")
    sensor = DateTimeSensor(task_id="s", target_time="2030-07-01T08:00:00", deferrable=False)
    expected = dt.datetime(2030, 7, 1, 8, 0, tzinfo=ZoneInfo("America/New_York"))
    assert sensor.target(make_context(sensor)) == expected
    aware = DateTimeSensor(task_id="a", target_time="2030-07-01T08:00:00+00:00")
    assert aware.target(make_context(aware)) == dt.datetime(2030, 7, 1, 8, tzinfo=dt.UTC)


def test_naive_target_defers_with_an_aware_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """What travels to the triggerer is tz-aware, whatever the DAG file wrote."""
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "Asia/Tokyo")
    sensor = DateTimeSensorAsync(task_id="s", target_time=dt.datetime(2999, 1, 1, 9, 0))
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(make_context(sensor))
    moment = info.value.trigger.serialize()[1]["moment"]
    assert moment == dt.datetime(2999, 1, 1, 0, 0, tzinfo=dt.UTC)
    assert moment.tzinfo is not None


def test_datetime_sensor_bad_target_string_fails_naming_it() -> None:
    sensor = DateTimeSensor(task_id="s", target_time="next tuesday", deferrable=False)
    with pytest.raises(FailTask, match="'s': target_time 'next tuesday' is not an ISO 8601"):
        sensor.execute(make_context(sensor))


def test_datetime_sensor_target_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(DagDefinitionError, match="'s': target_time must be a datetime or"):
        DateTimeSensor(task_id="s", target_time=1893456000)  # type: ignore[arg-type]


def test_sensor_in_a_dag_hashes_its_dag_id_into_the_jitter() -> None:
    with DAG("one"):
        first = scripted(False, poke_interval=1000, exponential_backoff=True, timeout=10**7)
    with DAG("two"):
        second = scripted(False, poke_interval=1000, exponential_backoff=True, timeout=10**7)
    delays = {s._next_poke_interval(5.0, 0, 6) for s in (first, second)}
    assert len(delays) == 2  # same task id and wait, different DAGs: different jitter
