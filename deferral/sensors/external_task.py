"""ExternalTaskSensor and ExternalTaskMarker (Airflow's ``airflow.sensors.external_task``): wait
for tasks, a task group or a whole run of another DAG at the same (or a related) logical date;
mark a task that another DAG's task depends on, so that clearing it with its downstream tasks
clears that task too."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from typing import Any, NoReturn

from deferral.authoring.markers import StoredMarker
from deferral.context import Context
from deferral.dag import DAG
from deferral.exceptions import DagDefinitionError, DagNotFound, DeferralException, SkipTask
from deferral.operators.empty import EmptyOperator
from deferral.operators.python import call_with_context
from deferral.sensors.base import BaseSensorOperator
from deferral.states import DagRunState, TaskState
from deferral.store.seam import metastore, task_runtime
from deferral.triggers.external_task import WorkflowTrigger
from deferral.utils.sensor_helper import (
    ExternalStatus,
    date_argument,
    external_status,
    read_states,
)

DateFunction = Any  # a callable: (logical_date, **context) -> a datetime or a list of them


def _states(where: str, name: str, given: Collection[str] | None, default: list[str]) -> list[str]:
    if given is None:
        return default
    if isinstance(given, str):
        raise DagDefinitionError(f"{where}: {name} must be a list of states, not a string")
    return [str(state) for state in given]


class ExternalTaskSensor(BaseSensorOperator):
    """Waits until ``external_task_id`` (or each of ``external_task_ids``, or every task of the
    task group ``external_task_group_id``) of ``external_dag_id`` (or, with none of them, that
    DAG's run) is in ``allowed_states`` (default success) in the run at this run's logical date,
    minus ``execution_delta``, or at the date(s) ``execution_date_fn(logical_date, **context)``
    returns. Anything in ``failed_states`` fails the sensor (skipped with ``soft_fail``),
    anything in ``skipped_states`` skips it, as Airflow 2.10 does. With ``check_existence`` a
    DAG or task that does not exist fails it at once; a task group that does not exist always
    does (as Airflow 3). Modes poke and reschedule, or
    ``deferrable=True`` (a WorkflowTrigger polling every ``poll_interval`` seconds)."""

    template_fields: Sequence[str] = (
        "external_dag_id",
        "external_task_id",
        "external_task_ids",
        "external_task_group_id",
    )

    def __init__(
        self,
        *,
        external_dag_id: str,
        external_task_id: str | None = None,
        external_task_ids: Collection[str] | None = None,
        external_task_group_id: str | None = None,
        allowed_states: Collection[str] | None = None,
        skipped_states: Collection[str] | None = None,
        failed_states: Collection[str] | None = None,
        execution_delta: dt.timedelta | None = None,
        execution_date_fn: DateFunction | None = None,
        check_existence: bool = False,
        poll_interval: float = 2.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        where = f"task {self.task_id!r}"
        self.allowed_states = _states(where, "allowed_states", allowed_states, [TaskState.SUCCESS])
        self.skipped_states = _states(where, "skipped_states", skipped_states, [])
        self.failed_states = _states(where, "failed_states", failed_states, [])
        both = set(self.allowed_states) & {*self.failed_states, *self.skipped_states}
        if both:
            raise DagDefinitionError(
                f"{where}: {sorted(both)} both allowed and failed or skipped states"
            )
        if external_task_id is not None and external_task_ids is not None:
            raise DagDefinitionError(
                f"{where}: give external_task_id or external_task_ids, not both"
            )
        if external_task_group_id is not None and (external_task_id or external_task_ids):
            raise DagDefinitionError(
                f"{where}: external_task_group_id excludes external_task_id(s)"
            )
        if external_task_ids is not None and len(set(external_task_ids)) < len(
            list(external_task_ids)
        ):
            raise DagDefinitionError(f"{where}: external_task_ids holds a task id twice")
        of_tasks = bool(external_task_id or external_task_ids or external_task_group_id)
        valid = {s.value for s in TaskState} if of_tasks else {s.value for s in DagRunState}
        invalid = sorted({*self.allowed_states, *self.failed_states, *self.skipped_states} - valid)
        if invalid:
            kind = "task" if of_tasks else "DAG run"
            raise DagDefinitionError(
                f"{where}: {invalid[0]!r} is not a {kind} state ({', '.join(sorted(valid))})"
            )
        if execution_delta is not None and execution_date_fn is not None:
            raise DagDefinitionError(
                f"{where}: give execution_delta or execution_date_fn, not both"
            )
        if execution_date_fn is not None and not callable(execution_date_fn):
            raise DagDefinitionError(f"{where}: execution_date_fn must be callable")
        if (
            isinstance(poll_interval, bool)
            or not isinstance(poll_interval, int | float)
            or poll_interval <= 0
        ):
            raise DagDefinitionError(f"{where}: poll_interval must be a number of seconds > 0")
        self.external_dag_id = external_dag_id
        self.external_task_id = external_task_id
        self.external_task_ids = None if external_task_ids is None else list(external_task_ids)
        self.external_task_group_id = external_task_group_id
        self.execution_delta = execution_delta
        self.execution_date_fn = execution_date_fn
        self.check_existence = check_existence
        self.poll_interval = poll_interval
        self._checked_existence = False

    # -- what is waited for --------------------------------------------------------------------

    def logical_dates(self, context: Context) -> list[dt.datetime]:
        """The logical dates of the external runs to look at."""
        logical_date = context["logical_date"]
        if self.execution_delta is not None:
            return [logical_date - self.execution_delta]
        if self.execution_date_fn is None:
            return [logical_date]
        others = {k: v for k, v in context.items() if k not in ("logical_date", "execution_date")}
        found = call_with_context(
            self.execution_date_fn, [logical_date], {}, {**others, "context": context}
        )
        dates = found if isinstance(found, list | tuple) else [found]
        for date in dates:
            if not isinstance(date, dt.datetime) or date.utcoffset() is None:
                raise TypeError(f"execution_date_fn returned {date!r}: expected tz-aware datetimes")
        return list(dates)

    def _external_dag(self) -> DAG | None:
        try:
            return task_runtime().get_dag(str(self.external_dag_id))
        except DagNotFound:
            if self.check_existence:
                raise DeferralException(
                    f"the external DAG {self.external_dag_id!r} does not exist"
                ) from None
            return None

    def task_ids(self) -> list[str] | None:
        """The external task ids waited for; None: the external run itself."""
        if self.external_task_group_id is not None:
            dag = self._external_dag()
            group = None if dag is None else dag.task_group_dict.get(self.external_task_group_id)
            if group is None:  # fails at once, as Airflow 3 (its API answers 404)
                self._missing(f"task group {self.external_task_group_id!r}")
            return [task.task_id for task in group]
        ids = (
            self.external_task_ids
            if self.external_task_ids is not None
            else [self.external_task_id]
            if self.external_task_id is not None
            else None
        )
        if self.check_existence and not self._checked_existence:
            dag = self._external_dag()
            assert dag is not None
            for task_id in ids or []:
                if task_id not in dag.task_dict:
                    self._missing(f"task {task_id!r}")
            self._checked_existence = True
        return ids

    def _missing(self, what: str) -> NoReturn:
        raise DeferralException(
            f"the external {what} of DAG {self.external_dag_id!r} does not exist"
        )

    # -- poking ----------------------------------------------------------------------------------

    def poke(self, context: Context) -> bool:
        dates, task_ids = self.logical_dates(context), self.task_ids()
        waited = f"{task_ids or 'the run'} of DAG {self.external_dag_id!r}"
        print(f"poking for {waited} at {', '.join(d.isoformat() for d in dates)}", flush=True)
        with metastore().sessions() as session:
            states = read_states(session, str(self.external_dag_id), dates, task_ids)
        status = external_status(
            states,
            dates,
            task_ids,
            allowed=self.allowed_states,
            failed=self.failed_states,
            skipped=self.skipped_states,
        )
        if status is not None:
            self._ended(status, waited)
        return status is ExternalStatus.SUCCESS

    def _ended(self, status: ExternalStatus, waited: str) -> None:
        if status is ExternalStatus.FAILED:
            message = f"{waited} is in a failed state ({self.failed_states})"
            if self.soft_fail:
                raise SkipTask(message)
            raise DeferralException(message)
        if status is ExternalStatus.SKIPPED:
            raise SkipTask(f"{waited} is in a skipped state ({self.skipped_states})")

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        return self.poke_then_defer(
            context,
            lambda: WorkflowTrigger(
                external_dag_id=str(self.external_dag_id),
                logical_dates=self.logical_dates(context),
                external_task_ids=self.task_ids(),
                allowed_states=self.allowed_states,
                failed_states=self.failed_states,
                skipped_states=self.skipped_states,
                poll_interval=self.poll_interval,
            ),
        )

    def execute_complete(self, context: Context, event: Any = None) -> None:
        status = event.get("status") if isinstance(event, dict) else None
        try:
            ended = ExternalStatus(str(status))
        except ValueError:
            raise DeferralException(f"unexpected event from the trigger: {event!r}") from None
        self._ended(ended, f"{self.task_ids() or 'the run'} of DAG {self.external_dag_id!r}")


class ExternalTaskMarker(EmptyOperator):
    """Marks that ``external_task_id`` of ``external_dag_id``, in its run at ``logical_date``
    (templated, default this run's logical date; ``execution_date`` is Airflow 2's name),
    depends on this task: clearing this task with its downstream tasks (``deferral tasks clear
    --downstream``, the web UI) also clears that task and its downstream tasks, following
    markers there too, at most ``recursion_depth`` DAGs deep."""

    template_fields: Sequence[str] = ("external_dag_id", "external_task_id", "logical_date")

    def __init__(
        self,
        *,
        external_dag_id: str,
        external_task_id: str,
        logical_date: str | dt.datetime | None = None,
        execution_date: str | dt.datetime | None = None,
        recursion_depth: int = 10,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        where = f"task {self.task_id!r}"
        date = date_argument(where, logical_date, execution_date)
        if date is None:
            date = "{{ logical_date.isoformat() }}"
        if isinstance(date, dt.datetime):
            date = date.isoformat()
        if isinstance(recursion_depth, bool) or not isinstance(recursion_depth, int):
            raise DagDefinitionError(f"{where}: recursion_depth must be an int")
        if recursion_depth <= 0:
            raise DagDefinitionError(f"{where}: recursion_depth must be > 0, got {recursion_depth}")
        self.external_dag_id = external_dag_id
        self.external_task_id = external_task_id
        self.logical_date: str = date
        self.recursion_depth = recursion_depth

    @property
    def execution_date(self) -> str:
        """Airflow 2's name of ``logical_date``."""
        return self.logical_date

    @property
    def marker_target(self) -> StoredMarker:
        """What a clear of this marker also clears, as a DAG's document keeps it."""
        return StoredMarker(
            str(self.external_dag_id),
            str(self.external_task_id),
            str(self.logical_date),
            self.recursion_depth,
        )
