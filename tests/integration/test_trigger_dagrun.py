"""TriggerDagRunOperator run in this process against PostgreSQL (its DAG bag the DAGs folder of
DEFERRAL_DAGS_FOLDER): the run it creates, and what it refuses, each in one line naming the
thing at fault, creating nothing."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral import DAG
from deferral.loading import task_runtime
from deferral.loading.dagbag import DagNotFound, process_dagbag
from deferral.operators.trigger_dagrun import TriggerDagRunOperator
from deferral.runtime.config import Settings
from deferral.store import actions
from deferral.store.tables import DagRun
from tests.unit.test_operators import make_context

TARGET = """
from deferral import DAG
from deferral.models.param import Param
from deferral.operators import EmptyOperator

with DAG("{dag_id}", params={{"n": Param(1, type="integer")}}):
    EmptyOperator(task_id="a")
"""


@pytest.fixture
def target(settings: Settings, write_dag: Callable[[str, str], Path]) -> Iterator[str]:
    dag_id = f"target_{uuid.uuid4().hex[:8]}"
    write_dag(dag_id, TARGET.format(dag_id=dag_id))
    process_dagbag.cache_clear()
    task_runtime.install()  # as a worker's task process does
    yield dag_id
    process_dagbag.cache_clear()


def run(dag_id: str, **kwargs: Any) -> Any:
    with DAG("controller", start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC)):
        op = TriggerDagRunOperator(task_id="t", trigger_dag_id=dag_id, **kwargs)
    context = make_context(op)
    op.execute(context)
    return context["ti"].xcoms


def runs(sessions: sessionmaker[Session], dag_id: str) -> list[DagRun]:
    with sessions() as session:
        return list(session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)).all())


def test_creates_a_manual_run_with_its_conf_at_its_logical_date(
    target: str, sessions: sessionmaker[Session]
) -> None:
    xcoms = run(target, conf={"n": 5}, logical_date="2024-03-01T06:00:00+01:00")
    (created,) = runs(sessions, target)
    assert created.logical_date == dt.datetime(2024, 3, 1, 5, tzinfo=dt.UTC)
    assert created.run_id == "manual__2024-03-01T06:00:00+01:00"
    assert created.conf == {"n": 5} and created.state == "queued"
    assert xcoms.pushed == [
        (7, "trigger_run_id", created.run_id),
        (7, "trigger_execution_date_iso", "2024-03-01T06:00:00+01:00"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"conf": {"n": "five"}}, actions.ActionError, "'five' is not of type 'integer'"),
        ({"conf": ["n"]}, TypeError, "conf must be a dict, got list"),
        ({"conf": {"at": dt.datetime(2024, 1, 1)}}, TypeError, "JSON serializable"),
        ({"logical_date": "tomorrow"}, ValueError, "'tomorrow' is not an ISO 8601 date-time"),
    ],
)
def test_bad_input_fails_naming_it_and_creates_nothing(
    target: str, sessions: sessionmaker[Session], kwargs: Any, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        run(target, **kwargs)
    assert runs(sessions, target) == []


def test_an_unknown_dag_fails_naming_it(target: str) -> None:
    with pytest.raises(DagNotFound, match="DAG 'no_such_dag' not found"):
        run("no_such_dag")
