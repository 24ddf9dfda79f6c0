"""DEFERRAL_AIRFLOW_IMPORTS: DAG files that import from ``airflow`` load unchanged while the DagBag
imports them (deferral.loading.airflow_imports), and only then."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from deferral import DAG
from deferral.exceptions import DagDefinitionError, FailTask, SkipTask, TaskDeferred
from deferral.loading import airflow_imports
from deferral.loading.dagbag import DagBag
from deferral.loading.policies import check_task_values
from deferral.operators import EmptyOperator
from deferral.operators.bash import BashOperator
from deferral.operators.hitl import ApprovalOperator
from deferral.sensors.base import BaseSensorOperator
from deferral.sensors.time_sensor import TimeSensorAsync
from tests.unit.dag_source import isolated_imports, load_source  # noqa: F401 (a fixture)

AIRFLOW_2_DAG = """\
import datetime as dt

from airflow import DAG
from airflow.models.param import Param
from airflow.operators.bash import BashOperator
from airflow.operators.empty import EmptyOperator
from airflow.operators.python import PythonOperator, get_current_context
from airflow.sensors.filesystem import FileSensor
from airflow.utils.edgemodifier import Label
from airflow.utils.trigger_rule import TriggerRule
from airflow.exceptions import AirflowSkipException
import airflow.utils.dates


def skip():
    raise AirflowSkipException("nothing to do")


with DAG(
    "{dag_id}",
    schedule="@daily",
    start_date=dt.datetime(2024, 1, 1),
    tags=["example"],
    params={"n": Param(1, type="integer")},
    default_args={"mode": "reschedule", "poke_interval": 5},
) as dag:
    wait = FileSensor(task_id="wait", filepath="/tmp/never")
    run = BashOperator(task_id="run", bash_command="echo {{ params.n }}")
    maybe = PythonOperator(task_id="maybe", python_callable=skip)
    end = EmptyOperator(task_id="end", trigger_rule=TriggerRule.ALL_DONE)
    wait >> Label("file there") >> run >> maybe >> end
    assert airflow.utils.dates.days_ago(0).hour == 0
"""

AIRFLOW_3_DAG = """\
import datetime as dt

from airflow.sdk import DAG, task, Label, get_current_context
from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.sensors.time import TimeSensorAsync


@task
def hello():
    return get_current_context()["ti"].task_id


with DAG("{dag_id}", schedule=None):
    wait = TimeSensorAsync(task_id="wait", target_time=dt.time(6, 0))
    wait >> Label("morning") >> hello() >> BashOperator(task_id="b", bash_command="true")
"""


pytestmark = pytest.mark.usefixtures("isolated_imports")


@pytest.fixture
def load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[DagBag, str]]:
    monkeypatch.setenv("DEFERRAL_AIRFLOW_IMPORTS", "true")
    return lambda source: load_source(tmp_path, source)


def test_airflow_2_dag_file_loads_unchanged(load: Callable[..., tuple[DagBag, str]]) -> None:
    bag, dag_id = load(AIRFLOW_2_DAG)
    assert bag.import_errors == {}
    dag = bag.dags[dag_id]
    assert dag.tags == ["example"]
    assert isinstance(dag.get_task("run"), BashOperator)  # deferral's own class
    wait = dag.get_task("wait")
    assert isinstance(wait, BaseSensorOperator) and (wait.mode, wait.poke_interval) == (
        "reschedule",
        5,
    )
    assert dag.get_edge_info("wait", "run") == {"label": "file there"}


def test_airflow_3_sdk_and_standard_provider_names(
    load: Callable[..., tuple[DagBag, str]],
) -> None:
    bag, dag_id = load(AIRFLOW_3_DAG)
    assert bag.import_errors == {}
    dag = bag.dags[dag_id]
    assert isinstance(dag.get_task("wait"), TimeSensorAsync)
    assert dag.get_task("b").upstream_task_ids == {"hello"}


AIRFLOW_31_HITL_DAG = """\
import datetime as dt

from airflow.sdk import DAG
from airflow.sdk.definitions.deadline import AsyncCallback, DeadlineAlert, DeadlineReference
from airflow.providers.standard.operators.hitl import ApprovalOperator


async def alert(**kwargs):
    pass


with DAG(
    "{dag_id}",
    deadline=DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=dt.timedelta(minutes=15),
        callback=AsyncCallback(alert),
    ),
):
    ApprovalOperator(task_id="approve", subject="Ship it?")
"""


def test_airflow_31_hitl_and_deadline_names(load: Callable[..., tuple[DagBag, str]]) -> None:
    bag, dag_id = load(AIRFLOW_31_HITL_DAG)
    assert bag.import_errors == {}
    dag = bag.dags[dag_id]
    assert isinstance(dag.get_task("approve"), ApprovalOperator)
    assert [a.interval for a in dag.deadline_alerts()] == [dt.timedelta(minutes=15)]


AIRFLOW_COMPAT_DAG = """\
import pendulum

from airflow.providers.common.compat.sdk import AirflowSkipException as CompatSkip, TriggerRule
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import dag, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, TaskDeferred


@dag(dag_id="{dag_id}", schedule=None, start_date=pendulum.datetime(2023, 1, 1, tz="UTC"))
def compat():
    @task
    def skip():
        raise AirflowSkipException("no")

    skip() >> EmptyOperator(task_id="last", trigger_rule=TriggerRule.ALL_DONE)


compat()
compat_names = (CompatSkip, AirflowSkipException, AirflowFailException, TaskDeferred)
"""


def test_common_compat_sdk_and_sdk_exceptions_are_deferrals_names(
    load: Callable[..., tuple[DagBag, str]],
) -> None:
    bag, dag_id = load(AIRFLOW_COMPAT_DAG)
    assert bag.import_errors == {}
    assert bag.dags[dag_id].get_task("last").trigger_rule == "all_done"
    module = next(m for m in sys.modules.values() if hasattr(m, "compat_names"))
    assert module.compat_names == (SkipTask, SkipTask, FailTask, TaskDeferred)


@pytest.mark.parametrize(
    ("line", "missing"),
    [
        (
            "from airflow.operators.python import _BasePythonVirtualenvOperator",
            "airflow.operators.python._BasePythonVirtualenvOperator",
        ),
        ("from airflow.utils.state import State", "airflow.utils.state"),
        ("import airflow.providers.amazon.aws.hooks.s3", "airflow.providers.amazon"),
        ("from airflow.sdk import ObjectStoragePath", "airflow.sdk.ObjectStoragePath"),
        ("from airflow.models import DagRun", "airflow.models.DagRun"),
        (
            "from airflow.providers.common.compat.sdk import ObjectStoragePath",
            "airflow.providers.common.compat.sdk.ObjectStoragePath",
        ),
        (
            "import airflow.providers.common.compat.openlineage",
            "airflow.providers.common.compat.openlineage",
        ),
    ],
)
def test_a_name_deferral_lacks_fails_naming_it_and_the_line(
    load: Callable[..., tuple[DagBag, str]], line: str, missing: str
) -> None:
    bag, _ = load(f"from airflow import DAG\n\n{line}\n")
    (error,) = bag.import_errors.values()
    assert error == f"ImportError: {missing} is not supported by deferral (line 3)"


def test_off_by_default_and_only_while_loading(
    load: Callable[..., tuple[DagBag, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    bag, _ = load(AIRFLOW_2_DAG)
    assert bag.import_errors == {}
    with pytest.raises(ModuleNotFoundError):  # outside DAG files, no airflow
        __import__("airflow.operators.bash")
    assert not any(name.split(".")[0] == "airflow" for name in sys.modules)
    monkeypatch.setenv("DEFERRAL_AIRFLOW_IMPORTS", "false")
    off, _ = load(AIRFLOW_2_DAG)
    (error,) = off.import_errors.values()
    assert error.startswith("ModuleNotFoundError: No module named 'airflow'")


def test_refuses_to_stand_in_for_a_real_airflow(
    load: Callable[..., tuple[DagBag, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    (site / "airflow").mkdir(parents=True)
    (site / "airflow" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    bag, _ = load("from airflow import DAG\n")
    (error,) = bag.import_errors.values()
    assert "a real airflow package is installed" in error and str(site) in error
    assert error.endswith("(line 1)")
    assert "airflow" not in sys.modules


def test_every_alias_resolves_to_deferral_objects() -> None:
    """Each alias module's listed names and forwarded module exist (no alias to nothing)."""
    import importlib

    for name, alias in airflow_imports.ALIASES.items():
        if alias.module is not None:
            importlib.import_module(alias.module)
        for target in alias.names.values():
            module, attr = target.split(":")
            assert hasattr(importlib.import_module(module), attr), (name, target)


@pytest.mark.parametrize(
    ("folder_file", "environ", "loads"),
    [
        ("airflow_imports = true\n", None, True),
        ("airflow_imports = false\n", None, False),
        ("", None, False),
        # DEFERRAL_AIRFLOW_IMPORTS, when set, decides over the folder's file.
        ("airflow_imports = true\n", "false", False),
        ("airflow_imports = false\n", "true", True),
    ],
)
def test_the_dags_folder_can_turn_airflow_imports_on(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    folder_file: str,
    environ: str | None,
    loads: bool,
) -> None:
    monkeypatch.delenv("DEFERRAL_AIRFLOW_IMPORTS", raising=False)
    if environ is not None:
        monkeypatch.setenv("DEFERRAL_AIRFLOW_IMPORTS", environ)
    bag, dag_id = load_source(tmp_path, AIRFLOW_2_DAG, {".deferral.toml": folder_file})
    assert (dag_id in bag.dags) is loads
    assert (bag.import_errors == {}) is loads


@pytest.mark.parametrize(
    ("folder_file", "said"),
    [
        ("airflow_imports = 'yes'\n", "airflow_imports must be a bool, not 'yes'"),
        ("airflow_import = true\n", "unknown setting 'airflow_import' (known: airflow_imports)"),
        ("airflow_imports = \n", "not TOML: "),
    ],
)
def test_a_bad_folder_settings_file_is_named_and_the_dags_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder_file: str, said: str
) -> None:
    monkeypatch.delenv("DEFERRAL_AIRFLOW_IMPORTS", raising=False)
    bag, dag_id = load_source(
        tmp_path,
        "from deferral import DAG\ndag = DAG('{dag_id}', schedule=None)\n",
        {".deferral.toml": folder_file},
    )
    assert dag_id in bag.dags  # a plain DAG file is not harmed
    settings = str(bag.folder / ".deferral.toml")
    assert bag.import_errors[settings].startswith(f"{settings}: {said}")


def test_assets_and_datasets_load_under_both_airflows_names(
    load: Callable[..., tuple[DagBag, str]],
) -> None:
    bag, _ = load(
        "from airflow.sdk import DAG, Asset, AssetWatcher\n"
        "from airflow.datasets import Dataset\n"
        "from airflow.triggers.base import BaseEventTrigger\n"
        "from airflow.operators.empty import EmptyOperator\n"
        "with DAG('on_assets', schedule=Asset('a') | Dataset('b')):\n"
        "    EmptyOperator(task_id='t', outlets=[Asset('c')])\n"
    )
    assert bag.import_errors == {}
    assert bag.dags["on_assets"].timetable.summary == "a | b"


def test_airflow_3_file_delete_triggers_watch_assets(
    load: Callable[..., tuple[DagBag, str]],
) -> None:
    bag, _ = load(
        "from airflow.providers.standard.triggers.file import (\n"
        "    DirectoryFileDeleteTrigger, FileDeleteTrigger,\n"
        ")\n"
        "from airflow.sdk import DAG, Asset, AssetWatcher\n"
        "inbox = DirectoryFileDeleteTrigger(directory='/tmp/inbox', filename='go')\n"
        "a = Asset('a', watchers=[AssetWatcher(name='w', trigger=FileDeleteTrigger('/tmp/t'))])\n"
        "b = Asset('b', watchers=[AssetWatcher(name='w', trigger=inbox)])\n"
        "with DAG('on_flags', schedule=[a, b]):\n"
        "    pass\n"
    )
    assert bag.import_errors == {}
    assert bag.dags["on_flags"].timetable.summary == "a & b"


AIRFLOW_EXAMPLES = Path(__file__).resolve().parents[1] / "airflow_examples"


def test_airflow_3_example_dags_load_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every DAG of the copies of Airflow's own examples (their folder turns the hook on)."""
    monkeypatch.delenv("DEFERRAL_AIRFLOW_IMPORTS", raising=False)
    bag = DagBag(AIRFLOW_EXAMPLES).collect()
    assert bag.import_errors == {}
    assert sorted(bag.dags) == [
        "aggregate_regional_sales",
        "asset1_producer",
        "asset2_producer",
        "asset_alias_example_alias_consumer",
        "asset_alias_example_alias_consumer_with_no_taskflow",
        "asset_alias_example_alias_producer",
        "asset_alias_example_alias_producer_with_no_taskflow",
        "asset_consumes_1",
        "asset_consumes_1_and_2",
        "asset_consumes_1_never_scheduled",
        "asset_consumes_unknown_never_scheduled",
        "asset_produces_1",
        "asset_produces_2",
        "asset_s3_bucket_consumer",
        "asset_s3_bucket_consumer_with_no_taskflow",
        "asset_s3_bucket_producer",
        "asset_s3_bucket_producer_with_no_taskflow",
        "asset_with_extra_by_context",
        "asset_with_extra_by_yield",
        "asset_with_extra_from_classic_operator",
        "clean_and_combine_player_stats",
        "compute_player_odds",
        "conditional_asset_and_time_based_timetable",
        "consume_1_and_2_with_asset_expressions",
        "consume_1_or_2_with_asset_expressions",
        "consume_1_or_both_2_and_3_with_asset_expressions",
        "consumes_asset_decorator",
        "daily_inference",
        "daily_team_a_rollup",
        "example_asset_state_store_consumer",
        "example_asset_state_store_producer",
        "example_bash_operator",
        "example_custom_weight",
        "example_dynamic_task_mapping",
        "example_external_task_marker_child",
        "example_external_task_marker_parent",
        "example_short_circuit_decorator",
        "example_task_group_mapping",
        "example_task_mapping_second_order",
        "example_task_state_store",
        "example_task_state_store_async",
        "example_task_state_store_mapped",
        "example_workday_timetable",
        "ingest_region_stats",
        "ingest_regional_sales",
        "ingest_team_a_player_stats",
        "live_region_player_stats",
        "monthly_team_a_rollup",
        "multi_region_player_stats",
        "player_odds_quality_check_wont_ever_to_trigger",
        "read_asset_event",
        "read_asset_event_from_classic",
        "regional_stats_breakdown",
        "scatter_live_region_to_segments",
        "segment_region_stats_early_rollup",
        "segment_region_stats_rollup",
        "summarize_live_region_stats",
        "team_analytics_producer",
        "team_b_player_stats",
        "team_c_player_stats",
        "team_ml_consumer",
        "trailing_week_inference",
        "train_weekly_model",
        "tutorial_taskflow_api_virtualenv",
    ]
    timetable = bag.dags["conditional_asset_and_time_based_timetable"].timetable
    assert timetable.summary == "s3://dag1/output_1.txt & s3://dag2/output_1.txt or 0 1 * * 3"


def test_airflow_3_takes_retry_delay_in_seconds() -> None:
    with DAG("retry_in_seconds") as dag:
        EmptyOperator(task_id="t", retry_delay=5)
        EmptyOperator(task_id="u", retry_delay="5")
    assert dag.get_task("t").retry_delay == dt.timedelta(seconds=5)
    with pytest.raises(DagDefinitionError, match=r"task 'u': retry_delay must be a timedelta"):
        check_task_values(dag.get_task("u"), "task 'u'")
