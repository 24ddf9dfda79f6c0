"""Airflow 2.10's module paths under deferral, and the small sensors and helpers behind them:
BashSensor, PythonSensor, TimeSensor(Async), DayOfWeekSensor, WeekDay, Label, Param,
get_current_context, days_ago."""

from __future__ import annotations

import datetime as dt
import importlib

import pytest

from deferral import DAG
from deferral.context import get_current_context
from deferral.context import make_context as real_context
from deferral.exceptions import DagDefinitionError, FailTask, TaskDeferred
from deferral.models.param import Param, ParamsDict, ParamValidationError
from deferral.operators import EmptyOperator
from deferral.sensors import PokeReturnValue
from deferral.sensors.bash import BashSensor
from deferral.sensors.python import PythonSensor
from deferral.sensors.time_sensor import TimeSensor, TimeSensorAsync
from deferral.sensors.weekday import DayOfWeekSensor
from deferral.utils.edgemodifier import Label
from deferral.utils.weekday import WeekDay
from tests.unit.test_operators import make_context

# What Airflow 2.10's example DAGs and "core concepts" docs import, by module and name.
AIRFLOW_PATHS = {
    "deferral.sensors.base": ["BaseSensorOperator", "PokeReturnValue"],
    "deferral.sensors.time_delta": ["TimeDeltaSensor", "TimeDeltaSensorAsync"],
    "deferral.sensors.date_time": ["DateTimeSensor", "DateTimeSensorAsync"],
    "deferral.sensors.filesystem": ["FileSensor"],
    "deferral.sensors.bash": ["BashSensor"],
    "deferral.sensors.python": ["PythonSensor"],
    "deferral.sensors.time_sensor": ["TimeSensor", "TimeSensorAsync"],
    "deferral.sensors.weekday": ["DayOfWeekSensor"],
    "deferral.operators.python": [
        "PythonOperator",
        "BranchPythonOperator",
        "ShortCircuitOperator",
        "get_current_context",
        "is_venv_installed",
        "PythonVirtualenvOperator",
        "ExternalPythonOperator",
        "BranchPythonVirtualenvOperator",
        "BranchExternalPythonOperator",
    ],
    "deferral.operators.email": ["EmailOperator"],
    "deferral.utils.email": ["send_email"],
    "deferral.operators.bash": ["BashOperator"],
    "deferral.operators.empty": ["EmptyOperator"],
    "deferral.operators.latest_only": ["LatestOnlyOperator"],
    "deferral.operators.weekday": ["BranchDayOfWeekOperator"],
    "deferral.operators.datetime": ["BranchDateTimeOperator"],
    "deferral.operators.trigger_dagrun": ["TriggerDagRunOperator"],
    "deferral.models.xcom": ["BaseXCom"],
    "deferral.timetables.base": ["Timetable", "DagRunInfo", "DataInterval", "TimeRestriction"],
    "deferral.sensors.external_task": ["ExternalTaskSensor", "ExternalTaskMarker"],
    "deferral.triggers.external_task": ["DagStateTrigger", "WorkflowTrigger"],
    "deferral.utils.dates": ["days_ago"],
    "deferral.utils.trigger_rule": ["TriggerRule"],
    "deferral.utils.edgemodifier": ["Label"],
    "deferral.utils.weekday": ["WeekDay"],
    "deferral.utils.task_group": ["TaskGroup"],
    "deferral.models.param": ["Param", "ParamsDict"],
    "deferral.models.baseoperator": ["BaseOperator", "chain", "cross_downstream"],
    "deferral.models.dag": ["DAG"],
    "deferral.models": ["DAG", "BaseOperator", "Param", "Variable", "Connection", "Dag"],
    "deferral.sensors": ["FileSensor", "BashSensor", "DayOfWeekSensor", "TimeSensorAsync"],
    "deferral.decorators": ["dag", "task", "task_group", "setup", "teardown"],
    "deferral.models.xcom_arg": ["XComArg"],
    "deferral.exceptions": [
        "AirflowException",
        "AirflowSkipException",
        "AirflowFailException",
        "AirflowSensorTimeout",
        "AirflowRescheduleException",
        "AirflowTaskTimeout",
    ],
}


def test_airflow_exception_names_are_deferral_s_own_classes() -> None:
    """A file whose imports were only renamed raises the same classes the hook maps to."""
    from deferral import exceptions
    from deferral.loading.airflow_imports import _EXCEPTIONS

    for name, target in _EXCEPTIONS.items():
        module, _, attr = target.partition(":")
        assert getattr(exceptions, name, None) in (
            None,
            getattr(importlib.import_module(module), attr),
        )
    assert exceptions.AirflowSkipException is exceptions.SkipTask


@pytest.mark.parametrize("module", sorted(AIRFLOW_PATHS))
def test_airflow_module_paths_exist(module: str) -> None:
    imported = importlib.import_module(module)
    for name in AIRFLOW_PATHS[module]:
        assert getattr(imported, name) is not None, f"{module}.{name}"


def test_names_not_implemented_fail_by_name() -> None:
    """A feature deferral lacks is no silent stand-in: importing it fails, naming it."""
    with pytest.raises(ImportError, match="_BasePythonVirtualenvOperator"):
        exec("from deferral.operators.python import _BasePythonVirtualenvOperator", {})
    with pytest.raises(AttributeError, match="XCom2"):
        importlib.import_module("deferral.models").XCom2  # noqa: B018


# -- BashSensor ---------------------------------------------------------------------------------


def bash_sensor(command: str, **kwargs: object) -> BashSensor:
    with DAG("bash_sensor_dag"):
        return BashSensor(task_id="b", bash_command=command, **kwargs)  # type: ignore[arg-type]


def test_bash_sensor_done_on_zero_not_yet_otherwise() -> None:
    ok = bash_sensor("exit 0")
    assert ok.poke(make_context(ok)) is True
    waiting = bash_sensor("exit 3")
    assert waiting.poke(make_context(waiting)) is False


def test_bash_sensor_retry_exit_code_fails_on_other_codes() -> None:
    sensor = bash_sensor("exit 3", retry_exit_code=1)
    with pytest.raises(FailTask, match="code 3"):
        sensor.poke(make_context(sensor))
    again = bash_sensor("exit 1", retry_exit_code=1)
    assert again.poke(make_context(again)) is False


def test_bash_sensor_env_replaces_environment_and_adds_run_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sensor = bash_sensor('echo "[$GREETING][$HOME][$AIRFLOW_CTX_TASK_ID]"', env={"GREETING": "hi"})
    assert sensor.poke(make_context(sensor)) is True
    assert "[hi][][b]" in capsys.readouterr().out


def test_bash_sensor_refuses_bad_arguments() -> None:
    with pytest.raises(DagDefinitionError, match="'b': retry_exit_code"):
        bash_sensor("true", retry_exit_code="1")
    with pytest.raises(DagDefinitionError, match="'b': bash_command"):
        bash_sensor("")


# -- PythonSensor -------------------------------------------------------------------------------


def test_python_sensor_pokes_callable_with_context_and_op_kwargs() -> None:
    seen: list[object] = []

    def ready(limit: int, ti: object, templates_dict: object) -> bool:
        seen.append((limit, templates_dict))
        return limit > 1

    with DAG("python_sensor_dag"):
        sensor = PythonSensor(
            task_id="p", python_callable=ready, op_kwargs={"limit": 2}, templates_dict={"a": 1}
        )
    assert sensor.poke(make_context(sensor)) is True
    assert seen == [(2, {"a": 1})]


def test_python_sensor_passes_poke_return_value_through() -> None:
    with DAG("python_sensor_xcom"):
        sensor = PythonSensor(
            task_id="p", python_callable=lambda: PokeReturnValue(True, xcom_value="v")
        )
    result = sensor.poke(make_context(sensor))
    assert isinstance(result, PokeReturnValue) and result.xcom_value == "v"


# -- TimeSensor, DayOfWeekSensor ----------------------------------------------------------------


def test_time_sensor_waits_for_time_of_day_in_dag_zone() -> None:
    with DAG("time_sensor_dag", start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC)):
        passed = TimeSensor(task_id="passed", target_time=dt.time(0, 0))
        later = TimeSensor(task_id="later", target_time=dt.time(23, 59, 59, 999999))
    assert passed.poke(make_context(passed)) is True
    assert later.poke(make_context(later)) is False
    target = later.target(make_context(later))
    assert target.tzinfo is not None and target.time() == dt.time(23, 59, 59, 999999)


def test_time_sensor_async_defers_until_target() -> None:
    with DAG("time_sensor_async_dag"):
        sensor = TimeSensorAsync(task_id="t", target_time=dt.time(23, 59, 59, 999999))
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(make_context(sensor))
    assert deferred.value.method_name == "execute_complete"


def test_time_sensor_refuses_a_datetime() -> None:
    with DAG("time_sensor_bad"), pytest.raises(DagDefinitionError, match="'t': target_time"):
        TimeSensor(task_id="t", target_time=dt.datetime(2024, 1, 1))  # type: ignore[arg-type]


def test_day_of_week_sensor_on_logical_date() -> None:
    saturday = dt.datetime(2024, 1, 6, tzinfo=dt.UTC)
    with DAG("weekday_dag"):
        weekend = DayOfWeekSensor(
            task_id="weekend",
            week_day={"Saturday", WeekDay.SUNDAY},
            use_task_logical_date=True,
        )
        monday = DayOfWeekSensor(task_id="monday", week_day="MONDAY", use_task_logical_date=True)
    assert weekend.poke(make_context(weekend, logical_date=saturday)) is True
    assert monday.poke(make_context(monday, logical_date=saturday)) is False


def test_weekday_names_and_bad_day() -> None:
    assert WeekDay.validate_week_day(["monday", WeekDay.FRIDAY]) == {1, 5}
    with DAG("weekday_bad"), pytest.raises(DagDefinitionError, match=r"'w': week_day.*Funday"):
        DayOfWeekSensor(task_id="w", week_day="Funday")


# -- Label --------------------------------------------------------------------------------------


def test_label_wires_and_labels_edges() -> None:
    with DAG("labels") as dag:
        branch, yes, no, join = (EmptyOperator(task_id=t) for t in ("branch", "yes", "no", "join"))
        branch >> Label("when yes") >> yes
        branch >> Label("otherwise") >> [no, join]
        [yes, no] >> Label("then") >> join
    assert join.upstream_task_ids == {"branch", "yes", "no"}
    assert dag.get_edge_info("branch", "yes") == {"label": "when yes"}
    assert dag.get_edge_info("branch", "join") == {"label": "otherwise"}
    assert dag.get_edge_info("no", "join") == {"label": "then"}
    assert dag.get_edge_info("yes", "no") == {}


def test_label_alone_is_refused() -> None:
    with DAG("labels_alone"):
        task = EmptyOperator(task_id="t")
        with pytest.raises(DagDefinitionError, match="nothing upstream"):
            Label("x") >> task


# -- Param --------------------------------------------------------------------------------------


def test_param_checks_schema_and_context_sees_values() -> None:
    param = Param(5, type="integer", minimum=1, description="how many")
    assert param.resolve() == 5 and param.resolve(7) == 7
    with pytest.raises(ParamValidationError, match="'n': 0 is invalid"):
        param.resolve(0, name="n")
    with pytest.raises(ParamValidationError, match="no value and no default"):
        Param(type="string").resolve()
    params = ParamsDict({"n": param, "plain": "x"})
    assert dict(params) == {"n": 5, "plain": "x"}


def test_bad_param_default_is_refused_naming_it() -> None:
    with pytest.raises(DagDefinitionError, match="DAG 'bad_param': param 'n': 'many' is invalid"):
        DAG("bad_param", params={"n": Param("many", type="integer")})
    with DAG("bad_task_param"), pytest.raises(DagDefinitionError, match="task 't': param 'k'"):
        EmptyOperator(task_id="t", params={"k": Param(-1, minimum=0)})


def test_params_reach_the_context_as_values_and_current_context_is_set() -> None:
    with DAG("param_ctx", params={"n": Param(5, type="integer"), "who": Param(type="string")}):
        task = EmptyOperator(task_id="t", params=ParamsDict({"k": Param("v")}))
    fake = make_context(task)
    context = real_context(task, fake["dag_run"], fake["ti"])
    assert context["params"] == {"n": 5, "who": None, "k": "v", "c": 1}
    assert get_current_context() is context


def test_days_ago_is_midnight_utc_n_days_back() -> None:
    from deferral.utils.dates import days_ago

    two = days_ago(2)
    today = dt.datetime.now(dt.UTC).date()
    assert two.tzinfo is not None and (today - two.date()).days == 2
    assert two.time() == dt.time(0, 0)
