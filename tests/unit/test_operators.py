"""deferral.operators and deferral.sensors."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from deferral import DAG
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance
from deferral.exceptions import (
    DagDefinitionError,
    RescheduleTask,
    SensorTimeout,
    SkipTask,
    TaskDeferred,
)
from deferral.operators import EmptyOperator, PythonOperator
from deferral.sensors import (
    BaseSensorOperator,
    DateTimeSensor,
    DateTimeSensorAsync,
    FileSensor,
    TimeDeltaSensor,
    TimeDeltaSensorAsync,
)
from deferral.triggers import DateTimeTrigger, FileTrigger

LOGICAL = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)
# A logical date whose waits are still ahead: a deferrable sensor pokes once before deferring.
FUTURE = dt.datetime(2999, 5, 1, 12, 0, tzinfo=dt.UTC)


class MemoryXComs:
    def __init__(self) -> None:
        self.pushed: list[tuple[int, str, Any]] = []

    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        self.pushed.append((task_instance_id, key, value))

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        return f"{dag_id}/{run_id}/{task_id}/{key}/{map_index}"


def make_context(
    task: Any, logical_date: dt.datetime = LOGICAL, first_started_at: dt.datetime | None = None
) -> Context:
    dag = task.dag or DAG("ctx_dag")
    ti = RuntimeTaskInstance(
        id=7,
        dag_id=dag.dag_id,
        run_id="run1",
        task_id=task.task_id,
        map_index=-1,
        try_number=1,
        xcoms=MemoryXComs(),
        first_started_at=first_started_at or dt.datetime.now(dt.UTC),
    )
    return {
        "ti": ti,
        "task": task,
        "dag": dag,
        "dag_run": DagRunInfo(dag.dag_id, "run1", logical_date, {"c": 1}),
        "run_id": "run1",
        "logical_date": logical_date,
        "params": {"p": 2},
        "try_number": 1,
    }


# -- EmptyOperator / PythonOperator ---------------------------------------------------------------


def test_empty_operator_returns_none() -> None:
    op = EmptyOperator(task_id="e")
    assert op.execute(make_context(op)) is None


def test_python_operator_passes_op_args_op_kwargs_and_named_context() -> None:
    seen: dict[str, Any] = {}

    def fn(a: int, b: int, *, c: int, ti: Any, logical_date: dt.datetime) -> int:
        seen.update(a=a, b=b, c=c, ti=ti, logical_date=logical_date)
        return a + b + c

    op = PythonOperator(task_id="p", python_callable=fn, op_args=[1, 2], op_kwargs={"c": 3})
    context = make_context(op)
    assert op.execute(context) == 6
    assert seen["ti"] is context["ti"]
    assert seen["logical_date"] == LOGICAL


def test_python_operator_only_passes_context_entries_its_signature_names() -> None:
    def fn(params: dict[str, Any]) -> dict[str, Any]:
        return params

    op = PythonOperator(task_id="p", python_callable=fn)
    assert op.execute(make_context(op)) == {"p": 2}


def test_python_operator_var_keyword_gets_whole_context() -> None:
    def fn(x: int, **kwargs: Any) -> tuple[int, set[str]]:
        return x, set(kwargs)

    op = PythonOperator(task_id="p", python_callable=fn, op_kwargs={"x": 5})
    x, names = op.execute(make_context(op))
    assert x == 5
    assert names == {
        "ti",
        "task",
        "dag",
        "dag_run",
        "run_id",
        "logical_date",
        "params",
        "try_number",
        "templates_dict",  # as Airflow's PythonOperator adds it to the context
    }


def test_python_operator_op_kwargs_win_over_context() -> None:
    def fn(params: Any, run_id: str) -> tuple[Any, str]:
        return params, run_id

    op = PythonOperator(task_id="p", python_callable=fn, op_kwargs={"params": "mine"})
    assert op.execute(make_context(op)) == ("mine", "run1")


def test_python_operator_with_no_arguments_and_builtin_callable() -> None:
    op = PythonOperator(task_id="p", python_callable=lambda: "ok")
    assert op.execute(make_context(op)) == "ok"
    op2 = PythonOperator(task_id="p2", python_callable=max, op_args=[3, 9, 4])
    assert op2.execute(make_context(op2)) == 9


def test_python_operator_copies_op_args_and_op_kwargs() -> None:
    args = [1]
    kwargs = {"k": 1}
    op = PythonOperator(task_id="p", python_callable=print, op_args=args, op_kwargs=kwargs)
    args.append(2)
    kwargs["k"] = 2
    assert op.op_args == [1]
    assert op.op_kwargs == {"k": 1}


def test_python_operator_non_callable_refused() -> None:
    with pytest.raises(DagDefinitionError, match="'p': python_callable is not callable"):
        PythonOperator(task_id="p", python_callable="print")  # type: ignore[arg-type]


def test_python_operator_xcom_via_ti() -> None:
    def fn(ti: RuntimeTaskInstance) -> Any:
        ti.xcom_push("k", 1)
        return ti.xcom_pull(task_ids=["up1", "up2"], key="k")

    op = PythonOperator(task_id="p", python_callable=fn)
    context = make_context(op)
    result = op.execute(context)
    # No map index asked: each task's value, whether it is mapped or not (map index None).
    assert result == ["ctx_dag/run1/up1/k/None", "ctx_dag/run1/up2/k/None"]
    assert context["ti"].xcoms.pushed == [(7, "k", 1)]  # type: ignore[attr-defined]
    assert context["ti"].xcom_pull("up1", map_indexes=2) == "ctx_dag/run1/up1/return_value/2"
    assert context["ti"].xcom_pull("up1", map_indexes=[0, 1]) == [
        "ctx_dag/run1/up1/return_value/0",
        "ctx_dag/run1/up1/return_value/1",
    ]


# -- DateTime / TimeDelta sensors -----------------------------------------------------------------


def test_datetime_sensor_async_defers_at_target_time() -> None:
    target = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=ZoneInfo("Europe/Paris"))
    sensor = DateTimeSensorAsync(task_id="s", target_time=target, timeout=120)
    assert sensor.deferrable is True
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(make_context(sensor))
    deferred = info.value
    assert isinstance(deferred.trigger, DateTimeTrigger)
    assert deferred.trigger.moment == target
    assert deferred.method_name == "execute_complete"
    assert deferred.timeout == dt.timedelta(seconds=120)
    assert deferred.kwargs == {}


def test_time_delta_sensor_async_waits_from_logical_date() -> None:
    sensor = TimeDeltaSensorAsync(task_id="s", delta=dt.timedelta(hours=2, minutes=30))
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(make_context(sensor, FUTURE))
    deferred = info.value
    assert isinstance(deferred.trigger, DateTimeTrigger)
    assert deferred.trigger.moment == FUTURE + dt.timedelta(hours=2, minutes=30)
    assert deferred.method_name == "execute_complete"
    # Default timeout of a sensor: 7 days.
    assert deferred.timeout == dt.timedelta(days=7)


def test_time_delta_sensor_async_serializes_the_absolute_moment() -> None:
    sensor = TimeDeltaSensorAsync(task_id="s", delta=dt.timedelta(minutes=5))
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(make_context(sensor, FUTURE))
    classpath, kwargs = info.value.trigger.serialize()
    assert classpath == "deferral.triggers.temporal.DateTimeTrigger"
    assert kwargs == {"moment": FUTURE + dt.timedelta(minutes=5)}


def test_async_sensors_cannot_be_made_non_deferrable() -> None:
    target = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    assert DateTimeSensorAsync(task_id="a", target_time=target, deferrable=False).deferrable
    assert TimeDeltaSensorAsync(task_id="b", delta=dt.timedelta(1), deferrable=False).deferrable


def test_execute_complete_returns_none() -> None:
    sensor = DateTimeSensorAsync(task_id="s", target_time=dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    assert sensor.execute_complete(make_context(sensor), event=LOGICAL) is None


@pytest.mark.parametrize("sensor_cls", [DateTimeSensor, DateTimeSensorAsync])
def test_naive_target_time_is_read_in_the_default_timezone(
    sensor_cls: type[DateTimeSensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "Europe/Paris")
    sensor = sensor_cls(task_id="s", target_time=dt.datetime(2030, 1, 1, 9, 0))
    assert sensor.target_time == dt.datetime(2030, 1, 1, 9, 0, tzinfo=ZoneInfo("Europe/Paris"))
    assert sensor.target(make_context(sensor)) == dt.datetime(2030, 1, 1, 8, 0, tzinfo=dt.UTC)


def test_datetime_sensor_poke_mode_returns_when_target_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEFERRAL_DEFAULT_DEFERRABLE", raising=False)
    sensor = DateTimeSensor(task_id="s", target_time=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    assert sensor.deferrable is False
    assert sensor.poke(make_context(sensor)) is True
    assert sensor.execute(make_context(sensor)) is None


def test_datetime_sensor_poke_false_before_target() -> None:
    sensor = DateTimeSensor(
        task_id="s", target_time=dt.datetime(2999, 1, 1, tzinfo=dt.UTC), deferrable=False
    )
    assert sensor.poke(make_context(sensor)) is False


def test_time_delta_sensor_target_is_logical_date_plus_delta() -> None:
    sensor = TimeDeltaSensor(task_id="s", delta=dt.timedelta(days=1), deferrable=False)
    assert sensor.target(make_context(sensor)) == LOGICAL + dt.timedelta(days=1)


def test_default_deferrable_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_DEFERRABLE", "true")
    sensor = TimeDeltaSensor(task_id="s", delta=dt.timedelta(hours=1))
    assert sensor.deferrable is True
    with pytest.raises(TaskDeferred):
        sensor.execute(make_context(sensor, FUTURE))


def test_explicit_deferrable_false_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_DEFERRABLE", "true")
    sensor = DateTimeSensor(
        task_id="s", target_time=dt.datetime(2000, 1, 1, tzinfo=dt.UTC), deferrable=False
    )
    assert sensor.execute(make_context(sensor)) is None


# -- poke-mode timeouts and FileSensor ------------------------------------------------------------


class NeverSensor(BaseSensorOperator):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pokes = 0

    def poke(self, context: Context) -> bool:
        self.pokes += 1
        return False


def test_poke_timeout_raises_sensor_timeout() -> None:
    sensor = NeverSensor(task_id="n", timeout=0.01, poke_interval=0.001, deferrable=False)
    with pytest.raises(SensorTimeout, match="'n' timed out: waited"):
        sensor.execute(make_context(sensor))
    assert sensor.pokes >= 2


def test_poke_timeout_with_soft_fail_skips() -> None:
    sensor = NeverSensor(
        task_id="n", timeout=0.01, poke_interval=0.001, soft_fail=True, deferrable=False
    )
    with pytest.raises(SkipTask):
        sensor.execute(make_context(sensor))


def test_unsupported_sensor_mode_refused() -> None:
    with pytest.raises(DagDefinitionError, match="mode 'sideways'"):
        NeverSensor(task_id="n", mode="sideways")


def test_sensor_unknown_argument_named() -> None:
    with pytest.raises(DagDefinitionError, match="poke_intervall"):
        NeverSensor(task_id="n", poke_intervall=3)


def test_file_sensor_deferrable_uses_file_trigger(tmp_path: Path) -> None:
    target = str(tmp_path / "flag")
    sensor = FileSensor(task_id="f", filepath=target, poke_interval=2.5, deferrable=True)
    with pytest.raises(TaskDeferred) as info:
        sensor.execute(make_context(sensor))
    trigger = info.value.trigger
    assert isinstance(trigger, FileTrigger)
    assert trigger.serialize() == (
        "deferral.triggers.file.FileTrigger",
        {"filepath": target, "poll_interval": 2.5, "recursive": False},
    )
    assert info.value.method_name == "execute_complete"


def test_file_sensor_poke_mode(tmp_path: Path) -> None:
    target = tmp_path / "flag"
    sensor = FileSensor(task_id="f", filepath=str(target), deferrable=False)
    assert sensor.poke(make_context(sensor)) is False
    target.write_text("x")
    assert sensor.poke(make_context(sensor)) is True
    assert sensor.execute(make_context(sensor)) is None


# -- reschedule mode ----------------------------------------------------------------------------


class Flag(BaseSensorOperator):
    def __init__(self, *, ready: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ready = ready

    def poke(self, context: Context) -> bool:
        return self.ready


def test_reschedule_mode_frees_the_slot_until_the_next_poke() -> None:
    sensor = Flag(task_id="flag", ready=False, mode="reschedule", poke_interval=30)
    before = dt.datetime.now(dt.UTC)
    with pytest.raises(RescheduleTask) as info:
        sensor.execute(make_context(sensor))
    assert before + dt.timedelta(seconds=30) <= info.value.reschedule_date
    assert info.value.reschedule_date <= dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)


def test_reschedule_mode_returns_when_the_poke_succeeds() -> None:
    sensor = Flag(task_id="flag", ready=True, mode="reschedule")
    assert sensor.execute(make_context(sensor)) is None


@pytest.mark.parametrize(("soft_fail", "raised"), [(False, SensorTimeout), (True, SkipTask)])
def test_reschedule_mode_times_out_from_the_tries_first_poke(
    soft_fail: bool, raised: type[Exception]
) -> None:
    sensor = Flag(task_id="flag", ready=False, mode="reschedule", timeout=60, soft_fail=soft_fail)
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=2)
    with pytest.raises(raised, match="longer than its timeout of 60s"):
        sensor.execute(make_context(sensor, first_started_at=long_ago))


def test_an_unknown_sensor_mode_is_refused_naming_it() -> None:
    with pytest.raises(DagDefinitionError, match="sensor mode 'sometimes' is not"):
        Flag(task_id="flag", ready=True, mode="sometimes")
