"""DAG files as Airflow has them, seen through the CLI and the scheduler against the real
database: an ignored file is not loaded, a zipped DAG is, a dag_policy that refuses shows as an
import error naming the policy, task_policy and task_instance_mutation_hook shape the task
instances the scheduler creates."""

from __future__ import annotations

import datetime as dt
import sys
import textwrap
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.loading.policies import LOCAL_SETTINGS_MODULE, load_policies
from deferral.runtime.config import Settings
from deferral.store import transitions
from deferral.store.tables import TaskInstance
from deferral_cli import main as deferral_main
from scheduler.service import SchedulerService
from tests.parsed_dags import record_dags_folder

LOCAL_SETTINGS = """
from deferral.exceptions import ClusterPolicyViolation


def dag_policy(dag):
    if not dag.dag_id.startswith("team_"):
        raise ClusterPolicyViolation(f"{dag.dag_id} has no team_ prefix")


def task_policy(task):
    task.retries = 2


def task_instance_mutation_hook(ti):
    if ti.task_id == "urgent":
        ti.priority_weight = 42
    if ti.task_id == "mapped":
        ti.priority_weight = 10 + ti.map_index
"""


def dag_source(dag_id: str, *task_ids: str) -> str:
    tasks = "".join(f"    EmptyOperator(task_id={t!r})\n" for t in task_ids or ("t",))
    return (
        "from deferral import DAG\nfrom deferral.operators import EmptyOperator\n\n"
        f"with DAG({dag_id!r}) as dag:\n{tasks}"
    )


@pytest.fixture
def policed_folder(
    settings: Settings, dags_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """The DAGs folder with cluster policies, a zipped DAG and an ignored file; the policies
    are forgotten afterwards so that they reach no other test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    load_policies.cache_clear()
    suffix = uuid.uuid4().hex[:8]
    (dags_folder / f"{LOCAL_SETTINGS_MODULE}.py").write_text(textwrap.dedent(LOCAL_SETTINGS))
    (dags_folder / f"rogue_{suffix}.py").write_text(dag_source("rogue"))
    (dags_folder / f"team_plain_{suffix}.py").write_text(dag_source("team_plain", "t", "urgent"))
    (dags_folder / f"scratch_{suffix}.py").write_text("raise RuntimeError('never loaded')\n")
    (dags_folder / ".deferralignore").write_text("scratch_\n")
    with zipfile.ZipFile(dags_folder / "packaged.zip", "w") as archive:
        archive.writestr(f"team_zipped_{suffix}.py", dag_source("team_zipped"))
    yield dags_folder
    load_policies.cache_clear()
    sys.modules.pop(LOCAL_SETTINGS_MODULE, None)


def test_dags_list_shows_zipped_dags_and_the_policys_refusal(
    policed_folder: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    record_dags_folder(settings)
    result = CliRunner().invoke(deferral_main, ["dags", "list"])
    assert result.exit_code == 1  # there is an import error
    listed = {line.split()[0] for line in result.stdout.splitlines()[1:]}  # under the header
    assert listed == {"team_plain", "team_zipped"}  # not the ignored file, not the refused DAG
    zipped = next(line for line in result.stdout.splitlines() if line.startswith("team_zipped"))
    assert "packaged.zip" in zipped
    errors = result.stderr.splitlines()
    assert len(errors) == 1
    assert "rogue_" in errors[0]
    assert errors[0].endswith(
        "ClusterPolicyViolation: deferral_local_settings.dag_policy refused DAG 'rogue': "
        "rogue has no team_ prefix"
    )


def test_the_scheduler_creates_task_instances_as_the_policies_shape_them(
    policed_folder: Path, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    service = SchedulerService(settings, name="s")
    service.refresh_dags()  # a running scheduler reads the folder off its loop
    with sessions.begin() as session:
        transitions.create_dag_run(session, "team_plain", "r1", dt.datetime.now(dt.UTC), {})
    service.start_queued_runs()
    with sessions() as session:
        tis = {ti.task_id: ti for ti in session.scalars(select(TaskInstance))}
    assert {t: ti.max_tries for t, ti in tis.items()} == {"t": 2, "urgent": 2}  # task_policy
    assert {t: ti.priority_weight for t, ti in tis.items()} == {"t": 1, "urgent": 42}  # the hook


def test_the_policies_shape_the_map_indexes_of_a_mapped_task(
    policed_folder: Path, settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    (policed_folder / f"team_mapped_{uuid.uuid4().hex[:8]}.py").write_text(
        "from deferral import DAG\nfrom deferral.operators import BashOperator\n\n"
        "with DAG('team_mapped'):\n"
        "    BashOperator.partial(task_id='mapped').expand(bash_command=['a', 'b', 'c'])\n"
    )
    service = SchedulerService(settings, name="s")
    service.attach(broker)  # the evaluation queues what it schedules
    service.refresh_dags()
    with sessions.begin() as session:
        transitions.create_dag_run(session, "team_mapped", "r1", dt.datetime.now(dt.UTC), {})
    service.start_queued_runs()
    service.evaluate_marked_runs()
    with sessions() as session:
        tis = session.scalars(select(TaskInstance).order_by(TaskInstance.map_index)).all()
    assert [ti.map_index for ti in tis] == [0, 1, 2]
    assert {ti.max_tries for ti in tis} == {2}  # task_policy set the mapped task's retries
    # The hook sees each map index it creates; map index 0 was the placeholder (-1), as Airflow.
    assert [ti.priority_weight for ti in tis] == [9, 11, 12]
