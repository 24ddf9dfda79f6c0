"""TriggerDagRunOperator (Airflow's ``airflow.operators.trigger_dagrun``): a task that creates a
manual run of another DAG of the folder and, with ``wait_for_completion``, waits for it to end,
holding its worker slot (polling every ``poke_interval``) or, with ``deferrable=True``, handing
the wait to a DagStateTrigger."""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.exceptions import ActionError, DagDefinitionError, DeferralException, SkipTask
from deferral.runtime.config import default_deferrable
from deferral.states import DagRunState, DagRunType
from deferral.store.seam import DagRun, metastore, task_runtime
from deferral.triggers.external_task import DagStateTrigger
from deferral.utils.sensor_helper import date_argument, parse_logical_date, run_of

log = logging.getLogger(__name__)

XCOM_RUN_ID = "trigger_run_id"
XCOM_LOGICAL_DATE_ISO = "trigger_execution_date_iso"  # Airflow 2.10's key


class DagRunAlreadyExists(DeferralException):
    """The DAG to trigger already has a run with that run id or at that logical date."""


def _run_states(task_id: str, name: str, given: Sequence[str] | None, default: str) -> list[str]:
    states = [default] if given is None else list(given)
    known = {state.value for state in DagRunState}
    for state in states:
        if state not in known:
            raise DagDefinitionError(
                f"task {task_id!r}: {name} holds {state!r}, not a DAG run state "
                f"({', '.join(sorted(known))})"
            )
    return [str(state) for state in states]


class TriggerDagRunOperator(BaseOperator):
    """Triggers a run of ``trigger_dag_id`` with ``conf``, at ``logical_date`` (a datetime or an
    ISO 8601 string; default now), its run id ``trigger_run_id`` or ``manual__<logical date>``;
    the run id is pushed as the XCom ``trigger_run_id``. A run already there (same run id or
    logical date) fails the task, is skipped with ``skip_when_already_exists``, or, with
    ``reset_dag_run``, has all its tasks cleared to run again (its conf unchanged). With
    ``wait_for_completion`` the task ends when the run is in ``allowed_states`` (default
    success) and fails when it is in ``failed_states`` (default failed)."""

    template_fields: Sequence[str] = (
        "trigger_dag_id",
        "trigger_run_id",
        "logical_date",
        "conf",
        "wait_for_completion",
        "skip_when_already_exists",
    )

    def __init__(
        self,
        *,
        trigger_dag_id: str,
        trigger_run_id: str | None = None,
        conf: dict[str, Any] | None = None,
        logical_date: str | dt.datetime | None = None,
        execution_date: str | dt.datetime | None = None,
        reset_dag_run: bool = False,
        wait_for_completion: bool = False,
        poke_interval: float = 60,
        allowed_states: Sequence[str] | None = None,
        failed_states: Sequence[str] | None = None,
        skip_when_already_exists: bool = False,
        deferrable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        where = f"task {self.task_id!r}"
        logical_date = date_argument(where, logical_date, execution_date)
        if isinstance(poke_interval, bool) or not isinstance(poke_interval, int | float):
            raise DagDefinitionError(f"{where}: poke_interval must be a number of seconds")
        if poke_interval <= 0:
            raise DagDefinitionError(f"{where}: poke_interval must be > 0, got {poke_interval}")
        self.trigger_dag_id = trigger_dag_id
        self.trigger_run_id = trigger_run_id
        self.conf = conf
        self.logical_date = logical_date
        self.reset_dag_run = reset_dag_run
        self.wait_for_completion = wait_for_completion
        self.poke_interval = float(poke_interval)
        self.allowed_states = _run_states(
            self.task_id, "allowed_states", allowed_states or None, DagRunState.SUCCESS
        )
        self.failed_states = _run_states(
            self.task_id, "failed_states", failed_states, DagRunState.FAILED
        )
        self.skip_when_already_exists = skip_when_already_exists
        self.deferrable = default_deferrable() if deferrable is None else deferrable

    @property
    def execution_date(self) -> str | dt.datetime | None:
        """Airflow 2's name of ``logical_date``."""
        return self.logical_date

    def _logical_date(self) -> dt.datetime:
        if self.logical_date is None or self.logical_date == "":
            return dt.datetime.now(dt.UTC)
        return parse_logical_date(self.logical_date)

    def _conf(self) -> dict[str, Any]:
        conf = {} if self.conf is None else self.conf
        if not isinstance(conf, dict):
            raise TypeError(f"conf must be a dict, got {type(conf).__name__}")
        try:
            json.dumps(conf)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"conf must be JSON serializable: {exc}") from None
        return conf

    def execute(self, context: Context) -> None:
        logical_date = self._logical_date()
        run_id = str(self.trigger_run_id or DagRunType.MANUAL.run_id(logical_date))
        runtime = task_runtime()
        dag = runtime.get_dag(str(self.trigger_dag_id))
        sessions = metastore().sessions
        try:
            runtime.trigger_run(dag, self._conf(), run_id, logical_date=logical_date)
            triggered_at = logical_date
        except ActionError as refused:
            with sessions() as session:
                existing = run_of(session, dag.dag_id, run_id=run_id, logical_date=logical_date)
            if existing is None:
                raise
            if self.reset_dag_run:
                print(f"clearing the run {existing.run_id!r} of DAG {dag.dag_id!r}", flush=True)
                runtime.clear_run(dag, existing.run_id)
            elif self.skip_when_already_exists:
                raise SkipTask(f"{refused} (skip_when_already_exists)") from None
            else:
                raise DagRunAlreadyExists(str(refused)) from None
            run_id, triggered_at = existing.run_id, existing.logical_date
        print(f"triggered DAG {dag.dag_id!r}: run {run_id!r}", flush=True)
        context["ti"].xcom_push(XCOM_RUN_ID, run_id)
        context["ti"].xcom_push(XCOM_LOGICAL_DATE_ISO, triggered_at.isoformat())
        if not self.wait_for_completion:
            return
        if self.deferrable:
            self.defer(
                trigger=DagStateTrigger(
                    dag_id=dag.dag_id,
                    states=[*self.allowed_states, *self.failed_states],
                    logical_dates=[triggered_at],
                    poll_interval=self.poke_interval,
                ),
                method_name="execute_complete",
            )
        while True:
            print(
                f"waiting for run {run_id!r} of DAG {dag.dag_id!r} to be in {self.allowed_states}",
                flush=True,
            )
            time.sleep(self.poke_interval)
            with sessions() as session:
                run = run_of(session, dag.dag_id, run_id=run_id, logical_date=None)
            if self._ended(run, run_id):
                return

    def _ended(self, run: DagRun | None, run_id: str) -> bool:
        """Whether the triggered run ended in an allowed state; raises if it is in a failed one
        (or gone)."""
        dag_id = self.trigger_dag_id
        if run is None:
            raise DeferralException(f"DAG {dag_id!r} has no run {run_id!r} any more")
        if run.state in self.failed_states:
            raise DeferralException(
                f"run {run.run_id!r} of DAG {dag_id!r} ended {run.state!r} (failed_states "
                f"{self.failed_states})"
            )
        if run.state in self.allowed_states:
            print(f"run {run.run_id!r} of DAG {dag_id!r} ended {run.state!r}", flush=True)
            return True
        return False

    def execute_complete(self, context: Context, event: Any = None) -> None:
        """Resumed by the DagStateTrigger: the run is in an allowed or a failed state."""
        logical_date = event["logical_dates"][0] if isinstance(event, dict) else None
        with metastore().sessions() as session:
            run = run_of(session, str(self.trigger_dag_id), run_id=None, logical_date=logical_date)
        if not self._ended(run, f"at {logical_date}"):
            raise DeferralException(
                f"DAG {self.trigger_dag_id!r}: the run at {logical_date} is "
                f"{run.state if run else None!r}, in neither {self.allowed_states} nor "
                f"{self.failed_states}"
            )
