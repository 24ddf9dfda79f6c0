"""Every argument Airflow 2.10 accepts on DAG, BaseOperator and the shipped operators is honoured
or refused by name (deferral.authoring.airflow_arguments); default_args apply as in Airflow."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deferral import DAG, task
from deferral.authoring.airflow_arguments import DAG_INERT, TASK_INERT, TASK_KEPT
from deferral.exceptions import DagDefinitionError
from deferral.loading.dagbag import DagBag
from deferral.operators import BashOperator, EmptyOperator, PythonOperator
from deferral.priority_strategy import DecreasingPriorityStrategy, PriorityWeightStrategy
from deferral.sensors import BaseSensorOperator, FileSensor, TimeDeltaSensor
from deferral.store.tables import DagRun
from deferral.utils.task_group import TaskGroup
from scheduler.waiting import new_task_instance
from tests.unit.dag_source import isolated_imports, load_source  # noqa: F401 (a fixture)

START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


pytestmark = pytest.mark.usefixtures("isolated_imports")


@pytest.fixture
def load(tmp_path: Path) -> Callable[[str], DagBag]:
    return lambda source: load_source(tmp_path, source)[0]


def only_error(bag: DagBag) -> str:
    assert len(bag.import_errors) == 1, bag.import_errors
    return next(iter(bag.import_errors.values()))


# -- default_args, as Airflow applies them --------------------------------------------------------


def test_sensor_defaults_from_default_args(load: Callable[[str], DagBag]) -> None:
    """Acceptance: mode="reschedule" and poke_interval=5 in default_args reach the sensors."""
    bag = load(
        """
        import datetime as dt
        from deferral import DAG
        from deferral.operators.bash import BashOperator
        from deferral.sensors.filesystem import FileSensor
        from deferral.sensors.time_delta import TimeDeltaSensor

        with DAG(
            "sensor_defaults",
            default_args={"mode": "reschedule", "poke_interval": 5, "timeout": 60,
                          "env": {"A": "1"}, "retries": 2},
        ) as dag:
            wait_file = FileSensor(task_id="wait_file", filepath="/tmp/x")
            wait_time = TimeDeltaSensor(task_id="wait_time", delta=dt.timedelta(1), timeout=30)
            run = BashOperator(task_id="run", bash_command="echo hi")
            wait_file >> wait_time >> run
        """
    )
    assert bag.import_errors == {}
    dag = bag.dags["sensor_defaults"]
    for task_id in ("wait_file", "wait_time"):
        sensor = dag.get_task(task_id)
        assert isinstance(sensor, BaseSensorOperator)
        assert (sensor.mode, sensor.poke_interval, sensor.retries) == ("reschedule", 5, 2)
    assert dag.get_task("wait_file").timeout == 60  # type: ignore[attr-defined]
    assert dag.get_task("wait_time").timeout == 30  # type: ignore[attr-defined]  # given wins
    assert dag.get_task("run").env == {"A": "1"}  # type: ignore[attr-defined]


def test_default_args_key_airflow_acts_on_fails_load_naming_it(
    load: Callable[[str], DagBag],
) -> None:
    """Acceptance: a key Airflow acts on that deferral does not implement fails the load."""
    bag = load(
        """
        from deferral import DAG
        from deferral.operators.empty import EmptyOperator

        with DAG("past", default_args={"owner": "data", "retry_exponential_backoff": True}):
            EmptyOperator(task_id="a")
        """
    )
    error = only_error(bag)
    assert "task 'a': retry_exponential_backoff=True is not supported by deferral" in error
    assert error.endswith("(line 6)")  # the task's line
    assert bag.dags == {}


def test_default_args_without_tasks_and_in_groups_are_checked(
    load: Callable[[str], DagBag],
) -> None:
    error = only_error(
        load(
            """
            from deferral import DAG

            dag = DAG(
                "no_tasks",
                default_args={"run_as_user": "nobody"},
            )
            """
        )
    )
    assert "DAG 'no_tasks': default_args: run_as_user='nobody' is not supported" in error
    assert error.endswith("(line 4)")  # the DAG's line


def test_default_args_values_airflow_ignores_are_accepted(load: Callable[[str], DagBag]) -> None:
    """The usual Airflow default_args: owner, depends_on_past=False, an email with both flags
    off, retries, a key no operator takes (ignored by Airflow too)."""
    bag = load(
        """
        import datetime as dt
        from deferral import DAG
        from deferral.operators.empty import EmptyOperator

        default_args = {
            "owner": "airflow",
            "depends_on_past": False,
            "email": ["airflow@example.com"],
            "email_on_failure": False,
            "email_on_retry": False,
            "retries": 1,
            "retry_delay": dt.timedelta(minutes=5),
            "start_date": dt.datetime(2024, 1, 1),
            "sla": None,
            "something_custom": 3,
        }
        with DAG("usual", default_args=default_args, schedule="@daily") as dag:
            EmptyOperator(task_id="a")
        """
    )
    assert bag.import_errors == {}
    a = bag.dags["usual"].get_task("a")
    assert (a.owner, a.depends_on_past, a.retries) == ("airflow", False, 1)  # type: ignore[attr-defined]
    assert a.start_date == bag.dags["usual"].start_date  # type: ignore[attr-defined]


def test_email_arguments_are_honoured_and_checked() -> None:
    """An address with Airflow's default flags (both True) is kept for the alerts; a malformed
    address or flag is refused, naming it."""
    with DAG("mail", default_args={"email": "ops@example.com"}):
        task = EmptyOperator(task_id="a")
        quiet = EmptyOperator(task_id="b", email_on_failure=False)
        with pytest.raises(DagDefinitionError, match=r"email must be an address.*got 42"):
            EmptyOperator(task_id="c", email=42)
        with pytest.raises(DagDefinitionError, match="email_on_retry must be True or False"):
            EmptyOperator(task_id="d", email_on_retry="yes")
    assert task.email == "ops@example.com"  # type: ignore[attr-defined]
    assert quiet.email_on_failure is False  # type: ignore[attr-defined]


def test_group_and_task_default_args_apply_over_the_dags() -> None:
    with DAG("layers", default_args={"poke_interval": 1, "mode": "poke"}):
        with TaskGroup("g", default_args={"poke_interval": 2}):
            in_group = FileSensor(task_id="f", filepath="/x")
        own = FileSensor(task_id="own", filepath="/x", default_args={"mode": "reschedule"})
    assert (in_group.poke_interval, in_group.mode) == (2, "poke")
    assert (own.poke_interval, own.mode) == (1, "reschedule")


def test_default_args_reach_mapped_and_taskflow_tasks() -> None:
    @task
    def double(x: int) -> int:
        return x * 2

    with DAG("mapped_defaults", default_args={"retries": 3, "poke_interval": 7}):
        mapped = TimeDeltaSensor.partial(task_id="m").expand(delta=[dt.timedelta(1)])
        flow = double(1).operator
    assert mapped.retries == 3 and flow.retries == 3


# -- arguments given directly -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("retry_exponential_backoff", True),
        ("weight_rule", "downstream"),
        ("run_as_user", "nobody"),
        ("max_active_tis_per_dag", 1),
        ("executor_config", {"k8s": {}}),
        ("start_date", dt.datetime(2030, 1, 1, tzinfo=dt.UTC)),
    ],
)
def test_task_argument_airflow_acts_on_is_refused_by_name(name: str, value: Any) -> None:
    with DAG("refusals", start_date=START), pytest.raises(DagDefinitionError) as refused:
        EmptyOperator(task_id="t", **{name: value})
    assert str(refused.value).startswith(f"task 't': {name}=")
    assert "is not supported by deferral" in str(refused.value)


def test_inert_and_kept_task_arguments_are_accepted_and_kept() -> None:
    with DAG("kept", start_date=START):
        t = EmptyOperator(
            task_id="t",
            owner="team-a",
            task_display_name="Nice name",
            depends_on_past=False,
            weight_rule="absolute",
            max_active_tis_per_dag=None,
            start_date=dt.datetime(2024, 1, 1),  # the DAG's, naive: read in the default zone
        )
    assert (t.owner, t.task_display_name, t.weight_rule) == ("team-a", "Nice name", "absolute")  # type: ignore[attr-defined]


class _ByMapIndex(PriorityWeightStrategy):
    def get_weight(self, ti: Any) -> int:
        return 10 + ti.map_index


def test_a_priority_weight_strategy_weighs_each_new_task_instance() -> None:
    """Airflow 3's weight_rule: a PriorityWeightStrategy (an instance, or its class's dotted
    path) gives each task instance's priority weight when its run creates it, at try 0."""
    path = "deferral.priority_strategy.DecreasingPriorityStrategy"
    with DAG("weighed", start_date=START):
        by_instance = EmptyOperator(task_id="a", weight_rule=DecreasingPriorityStrategy())
        by_path = EmptyOperator(task_id="b", weight_rule=path)
        absolute = EmptyOperator(task_id="c", priority_weight=2, weight_rule="absolute")
        mapped = BashOperator.partial(task_id="d", weight_rule=_ByMapIndex()).expand(
            bash_command=["true", "true"]
        )
    assert by_path.weight_rule == DecreasingPriorityStrategy()  # type: ignore[attr-defined]
    run = DagRun(dag_id="weighed", run_id="r")
    weights = [new_task_instance(run, t).priority_weight for t in (by_instance, by_path, absolute)]
    assert weights == [4, 4, 2]
    assert new_task_instance(run, mapped, 3).priority_weight == 13


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("upstream", "summing it up or down the graph"),
        ("deferral.priority_strategy.ABSOLUTE", "is not a PriorityWeightStrategy subclass"),
        ("no_such_module.Strategy", "its class does not import"),
        (3, "it must be 'absolute', a PriorityWeightStrategy"),
    ],
)
def test_a_weight_rule_deferral_cannot_honour_is_refused(value: Any, said: str) -> None:
    with DAG("refusals", start_date=START), pytest.raises(DagDefinitionError, match=said):
        EmptyOperator(task_id="t", weight_rule=value)


def test_unknown_task_argument_is_still_refused() -> None:
    with DAG("unknown"), pytest.raises(DagDefinitionError, match=r"unknown argument.*colour"):
        EmptyOperator(task_id="t", colour="red")


def test_every_table_entry_is_exercised() -> None:
    """Each refused name refuses a value that acts and accepts one that does not."""
    for name, rule in TASK_INERT.items():
        assert not rule.does_nothing(object()), name
    for name, rule in DAG_INERT.items():
        assert not rule.does_nothing(object()), name
    assert not TASK_KEPT & TASK_INERT.keys()


# -- DAG arguments ------------------------------------------------------------------------------


def test_descriptive_dag_arguments_are_kept_and_checked() -> None:
    dag = DAG(
        "described",
        tags=["example", "etl", "example"],
        owner_links={"data": "https://example.com/team"},
        dag_display_name="Described DAG",
        default_view="graph",
        orientation="TB",
        doc_md="# hi",
    )
    assert dag.tags == ["example", "etl"]
    assert (dag.dag_display_name, dag.default_view, dag.orientation) == (
        "Described DAG",
        "graph",
        "TB",
    )
    assert dag.owner_links == {"data": "https://example.com/team"}
    with pytest.raises(DagDefinitionError, match="'d': orientation 'UP' is not one of"):
        DAG("d", orientation="UP")
    with pytest.raises(DagDefinitionError, match="'d': tags must be a list"):
        DAG("d", tags="etl")
    with pytest.raises(DagDefinitionError, match=r"'d': owner_links\['x'\]"):
        DAG("d", owner_links={"x": "javascript:alert(1)"})


def test_concurrency_is_max_active_tasks() -> None:
    with pytest.warns(DeprecationWarning, match="concurrency"):
        dag = DAG("old", concurrency=3)
    assert dag.max_active_tasks == 3


@pytest.mark.parametrize(
    ("name", "value"),
    [("fail_stop", True), ("access_control", {"role": {"can_read"}})],
)
def test_dag_argument_airflow_acts_on_is_refused_by_name(name: str, value: Any) -> None:
    with pytest.raises(DagDefinitionError, match=f"DAG 'd': {name}=.* is not supported"):
        DAG("d", **{name: value})
    DAG("d", **{name: None})  # the value under which Airflow does nothing either


def test_unknown_dag_argument_is_refused_naming_it() -> None:
    with pytest.raises(DagDefinitionError, match="DAG 'd': unknown argument colour"):
        DAG("d", colour="red")


# -- operator arguments -------------------------------------------------------------------------


def test_python_templates_exts_and_bash_output_processor(tmp_path: Path) -> None:
    with DAG("ops"):
        python = PythonOperator(task_id="p", python_callable=print, templates_exts=[".sql"])
        bash = BashOperator(task_id="b", bash_command="echo 7", output_processor=int)
        with pytest.warns(DeprecationWarning, match="skip_exit_code"):
            old = BashOperator(task_id="o", bash_command="exit 5", skip_exit_code=5)
    assert python.template_ext == (".sql",)
    assert old.skip_on_exit_code == (5,)
    from tests.unit.test_operators import make_context

    assert bash.execute(make_context(bash)) == 7
