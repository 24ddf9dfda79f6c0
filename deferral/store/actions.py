"""What a user does to DAGs and tasks: trigger a run, pause or unpause a DAG, clear or mark
tasks. The ``deferral`` command and the web UI both call these, so a click and a command take
the same path; each raises :class:`ActionError` with one line naming what is at fault.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from deferral.authoring.setup_teardown import GraphTask, SetupGraph, clearing_with
from deferral.dag import DAG
from deferral.exceptions import ActionError, DagNotFound
from deferral.runtime import controls, storable
from deferral.runtime.crypto import Cipher
from deferral.states import DagRunType, TaskState
from deferral.store import idempotency, transitions
from deferral.store.serialized_dags import (
    StoredDag,
    StoredMarker,
    StoredParam,
    read_dag_to_change,
    stored_params,
)
from deferral.store.tables import Dag, DagRun, TaskInstance
from deferral.timetables import UserTimetableError
from deferral.timetables.partitions import partition_key_error
from deferral.utils.sensor_helper import parse_logical_date, run_of

# Most bytes of a run's conf as JSON text (a run keeps its conf as long as the run is kept).
MAX_CONF_BYTES = 64 * 1024
# The states a user may mark a task with.
MARKABLE_STATES = (TaskState.SUCCESS, TaskState.FAILED, TaskState.SKIPPED)


def ti_label(task_id: str, map_index: int) -> str:
    """A task instance within its run: ``task``, or ``task[2]`` for map index 2 of a mapped
    task."""
    return task_id if map_index < 0 else f"{task_id}[{map_index}]"


def parse_conf(raw: str | None) -> dict[str, Any]:
    """A run's conf from its JSON text (empty: ``{}``); ValueError saying what is wrong."""
    if raw is None or not raw.strip():
        return {}
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_CONF_BYTES:
        raise ValueError(f"must be at most {MAX_CONF_BYTES} bytes of JSON, not {size}")
    storable.check(raw, "the text")  # argv's bytes that are not UTF-8 arrive as surrogates
    try:
        conf = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(conf, dict):
        raise ValueError("must be a JSON object")
    for key in conf:
        controls.check_id(key, "key")  # keys name params (and become ids in templates, logs)
    return storable.check(conf)


@dataclass(frozen=True)
class Triggered:
    run_id: str
    # The DAG is paused: the run waits until it is unpaused.
    paused: bool
    # A repeat of an idempotency key: the first trigger's run (this one created none).
    replayed: bool = False


@dataclass(frozen=True)
class IdempotencyKey:
    """An idempotency key given with a trigger: ``requester`` (a web user, None for the
    command line) is part of what the key is unique within; ``cipher`` signs the request's
    fingerprint."""

    key: str
    cipher: Cipher
    requester: str | None = None


def trigger_run(
    sessions: sessionmaker[Session],
    dag: DAG | StoredDag,
    conf: dict[str, Any],
    run_id: str | None = None,
    *,
    logical_date: dt.datetime | None = None,
    idempotency_key: IdempotencyKey | None = None,
    partition_key: str | None = None,
) -> Triggered:
    """Create a manual run of ``dag`` at ``logical_date`` (tz-aware; default now), its run id
    ``manual__<logical date>`` unless given; its ``Param``s must accept what ``conf`` gives
    them (and a param without a default must be given), as Airflow checks at trigger. A
    ``partition_key`` is the run's (its outlet events carry it), for a partitioned DAG only
    (``deferral.timetables.partitions.partition_key_error``). Under
    ``idempotency_key``, a repeat of the same trigger within the window creates nothing and
    answers the first's run (``replayed``); IdempotencyConflict for the key used with another
    trigger.

    ``dag`` is its parsed document (the web UI, the CLI: no DAG file is imported) unless its
    timetable is a DAG file's own (``StoredDag.timetable`` None), which only the DAG object
    gives the manual interval of; ``dags test`` and operators pass DAG objects."""
    made = None
    if idempotency_key is not None:
        scope = idempotency.RUNS
        if idempotency_key.requester is not None:
            scope = f"{scope}/{idempotency_key.requester}"
        try:
            made = idempotency.request(
                scope,
                idempotency_key.key,
                lambda: {
                    "dag_id": dag.dag_id,
                    "conf": conf,
                    "run_id": run_id,
                    "logical_date": None if logical_date is None else logical_date.isoformat(),
                    # Only when given: a trigger without one asks what it asked before.
                    **({} if partition_key is None else {"partition_key": partition_key}),
                },
            )
        except idempotency.IdempotencyError as exc:
            raise ActionError(str(exc)) from None
    params = (
        dag.params if isinstance(dag, StoredDag) else stored_params(dag.params, dag.param_specs)
    )
    check_conf(dag.dag_id, params, conf)
    if partition_key is not None:
        timetable = dag.rebuilt_timetable() if isinstance(dag, StoredDag) else dag.timetable
        refused = partition_key_error(dag.dag_id, timetable, partition_key)
        if refused is not None:
            raise ActionError(refused)
    logical_date = logical_date or dt.datetime.now(dt.UTC)
    if run_id is not None:
        try:
            controls.check_id(run_id, "run id")
        except ValueError as exc:
            raise ActionError(str(exc)) from None
    run_id = run_id or DagRunType.MANUAL.run_id(logical_date)
    # As Airflow: the interval the schedule would give a run at this moment.
    try:
        interval = dag.infer_manual_data_interval(logical_date)
    except UserTimetableError as exc:
        raise ActionError(f"DAG {dag.dag_id!r}: {exc}") from None
    exists = f"DAG {dag.dag_id!r} already has a run {run_id!r} or one at {logical_date.isoformat()}"

    def act() -> dict[str, Any]:
        transitions.create_dag_run(
            session,
            dag.dag_id,
            run_id,
            logical_date,
            conf,
            run_type=DagRunType.MANUAL,
            data_interval=(interval.start, interval.end),
            partition_key=partition_key,
        )
        row = session.get(Dag, dag.dag_id)
        return {"run_id": run_id, "paused": row is not None and row.is_paused}

    try:
        with sessions.begin() as session:
            cipher = None if idempotency_key is None else idempotency_key.cipher
            outcome = idempotency.once(session, cipher, made, act)
    except IntegrityError:
        raise ActionError(exists) from None
    answer = outcome.answer
    return Triggered(answer["run_id"], answer["paused"], outcome.replayed)


def check_conf(dag_id: str, params: Sequence[StoredParam], conf: Mapping[str, Any]) -> None:
    """What ``conf`` gives each param checked against its JSON schema, as ``Param.resolve``
    checks it; a param it does not give needs a default (the defaults were checked when the DAG
    loaded, and a secret one is masked in the document, so they are not read here)."""
    from deferral.models.param import NOTSET, Param, ParamValidationError

    for param in params:
        given = conf.get(param.name, NOTSET)
        if given is NOTSET and param.has_value:
            continue
        try:
            Param(**param.schema).resolve(given, name=param.name)
        except ParamValidationError as exc:
            raise ActionError(f"DAG {dag_id!r}: {exc}") from None


class Pausable(Protocol):
    """What pausing needs of a DAG: a DAG object, or its parsed document (``StoredDag``)."""

    @property
    def dag_id(self) -> str: ...
    @property
    def fileloc(self) -> Any: ...
    @property
    def max_active_tasks(self) -> int: ...
    @property
    def max_active_runs(self) -> int: ...


def set_paused(sessions: sessionmaker[Session], dag: Pausable, paused: bool) -> None:
    """Pause or unpause ``dag`` (its row is created if no scheduler wrote it yet)."""
    with sessions.begin() as session:
        # The scheduler fills in the rest of a row it has not written yet, and keeps is_paused.
        insert = pg_insert(Dag).values(
            dag_id=dag.dag_id,
            fileloc=dag.fileloc,
            is_paused=paused,
            max_active_tasks=dag.max_active_tasks,
            max_active_runs=dag.max_active_runs,
        )
        session.execute(
            insert.on_conflict_do_update(index_elements=[Dag.dag_id], set_={"is_paused": paused})
        )


@dataclass(frozen=True)
class UserChanges:
    """What a clear or mark did: (label, new state) of each task instance it moved, and the
    labels (with their state) of those it left alone because they were queued or running."""

    changed: list[tuple[str, str]]
    refused: list[str]


class TaskGraph(SetupGraph, Protocol):
    """What clearing and marking need of a DAG (its tasks' edges, setup and teardown flags and
    retries, and its ExternalTaskMarkers' targets): a DAG object (``dags test``, an operator's
    reset) or its parsed document (``StoredDag``: the web UI and the CLI import no DAG file)."""

    @property
    def dag_id(self) -> str: ...
    def downstream_of(self, task_id: str) -> set[str]: ...
    def marker_of(self, task_id: str) -> StoredMarker | None: ...


# change(session, task instance, its task in the DAG or None) -> whether it moved.
Change = Callable[[Session, TaskInstance, GraphTask | None], bool]
# A DAG by its id; raises DagNotFound.
FindDag = Callable[[str], TaskGraph]


def stored_dags(sessions: sessionmaker[Session]) -> FindDag:
    """The DAGs the schedulers parsed, by id (their documents)."""

    def find(dag_id: str) -> TaskGraph:
        with sessions() as session:
            dag = read_dag_to_change(session, dag_id)
        if dag is None:
            raise DagNotFound(f"DAG {dag_id!r} not found among the DAGs the schedulers parsed")
        return dag

    return find


def change_tasks(
    sessions: sessionmaker[Session],
    dag: TaskGraph,
    run_id: str,
    task_id: str,
    change: Change,
    *,
    downstream: bool = False,
    map_indexes: Sequence[int] = (),
    find_dag: FindDag | None = None,
) -> UserChanges:
    """Apply ``change`` to the task ``task_id`` of one run (its map indexes ``map_indexes``,
    else all) and, with ``downstream``, to every task downstream of it (all map indexes); a
    clear also to the setups and teardowns they bring (``setup_teardown.clearing_with``); a
    finished run reopens. A clear with ``downstream`` also clears the tasks ExternalTaskMarkers
    name (and theirs downstream), in the runs of the DAGs ``find_dag`` (default: the DAGs the
    schedulers parsed) gives; their labels are ``dag_id:task``."""
    if task_id not in dag.task_dict:
        raise ActionError(f"DAG {dag.dag_id!r} has no task {task_id!r}", not_found=True)
    task_ids = [task_id]
    if change is clear_change:
        # Clearing (not marking) a work task clears the setups it needs and their teardowns,
        # as Airflow's clear does: the work must find what its setup made.
        task_ids = [
            task_id,
            *sorted(clearing_with(dag, task_ids, downstream=downstream) - {task_id}),
        ]
    elif downstream:
        task_ids += sorted(dag.downstream_of(task_id))
    # Clearing downstream follows ExternalTaskMarkers into the runs they name, as Airflow's
    # recursive clear; every run to clear is found before any is cleared.
    marked = []
    if downstream and change is clear_change:
        marked = _marked_runs(sessions, dag, run_id, task_ids, find_dag or stored_dags(sessions))
    done = _change_run_tasks(sessions, dag, run_id, task_ids, change, task_id, map_indexes)
    for other, other_run_id, other_task_ids in marked:
        more = _change_run_tasks(sessions, other, other_run_id, other_task_ids, change, None, ())
        done.changed.extend((f"{other.dag_id}:{label}", state) for label, state in more.changed)
        done.refused.extend(f"{other.dag_id}:{label}" for label in more.refused)
    return done


def _marked_runs(
    sessions: sessionmaker[Session],
    dag: TaskGraph,
    run_id: str,
    task_ids: Sequence[str],
    find_dag: FindDag,
    depth: int = 0,
    limit: int | None = None,
) -> list[tuple[TaskGraph, str, list[str]]]:
    """(DAG, run id, task ids) of every external task an ExternalTaskMarker among ``task_ids``
    names, with its downstream tasks, followed through markers there; at most the first
    marker's ``recursion_depth`` DAGs deep (more is refused: a cycle, or too much to clear)."""
    found: list[tuple[TaskGraph, str, list[str]]] = []
    for task_id in task_ids:
        marker = dag.marker_of(task_id) if task_id in dag.task_dict else None
        if marker is None:
            continue
        limit = marker.recursion_depth if limit is None else limit
        if depth >= limit:
            raise ActionError(
                f"maximum recursion depth {limit} reached for ExternalTaskMarker "
                f"{task_id!r} of DAG {dag.dag_id!r}: too many tasks to clear, or DAGs "
                "whose markers form a cycle"
            )
        try:
            other = find_dag(marker.external_dag_id)
        except DagNotFound as exc:
            raise ActionError(f"ExternalTaskMarker {task_id!r}: {exc}") from None
        if marker.external_task_id not in other.task_dict:
            raise ActionError(
                f"ExternalTaskMarker {task_id!r}: DAG {other.dag_id!r} has no task "
                f"{marker.external_task_id!r}"
            )
        logical_date = _marker_date(sessions, dag.dag_id, run_id, task_id, marker)
        with sessions() as session:
            other_run = run_of(session, other.dag_id, run_id=None, logical_date=logical_date)
        if other_run is None:
            continue  # no run there at that date: nothing to clear
        other_ids = [marker.external_task_id, *sorted(other.downstream_of(marker.external_task_id))]
        found.append((other, other_run.run_id, other_ids))
        found += _marked_runs(
            sessions, other, other_run.run_id, other_ids, find_dag, depth + 1, limit
        )
    return found


def _marker_date(
    sessions: sessionmaker[Session],
    dag_id: str,
    run_id: str,
    task_id: str,
    marker: StoredMarker,
) -> dt.datetime:
    """The marker's ``logical_date`` rendered with what its run gives (``run_context``: its
    dates, conf and ``macros``; a DAG's own macros and the task's objects are its file's)."""
    import jinja2

    from deferral.authoring.templating import template_env
    from deferral.context import DagRunInfo, run_context

    with sessions() as session:
        run = run_of(session, dag_id, run_id=run_id, logical_date=None)
    assert run is not None
    where = f"ExternalTaskMarker {task_id!r} logical_date"
    try:
        template = template_env(None).from_string(marker.logical_date)
        rendered = template.render(run_context(DagRunInfo.of(run)))
    except jinja2.TemplateError as exc:
        raise ActionError(f"{where}: {type(exc).__name__}: {exc}") from None
    try:
        return parse_logical_date(rendered)
    except ValueError as exc:
        raise ActionError(f"{where}: {exc}") from None


def clear_run(sessions: sessionmaker[Session], dag: TaskGraph, run_id: str) -> UserChanges:
    """Run every task of one run again (Airflow's ``dag.clear`` of a run, as
    ``TriggerDagRunOperator(reset_dag_run=True)`` does); the run reopens."""
    task_ids = sorted(dag.task_dict)
    return _change_run_tasks(sessions, dag, run_id, task_ids, clear_change, None, ())


def _change_run_tasks(
    sessions: sessionmaker[Session],
    dag: TaskGraph,
    run_id: str,
    task_ids: Sequence[str],
    change: Change,
    task_id: str | None,
    map_indexes: Sequence[int],
) -> UserChanges:
    """Apply ``change`` to the task instances of ``task_ids`` in one run (of ``task_id``, only
    its map indexes ``map_indexes`` if given); the run reopens."""
    with sessions.begin() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag.dag_id, DagRun.run_id == run_id)
        ).one_or_none()
        if run is None:
            raise ActionError(f"DAG {dag.dag_id!r} has no run {run_id!r}", not_found=True)
        tis = session.scalars(
            select(TaskInstance)
            .where(
                TaskInstance.dag_id == dag.dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id.in_(task_ids),
            )
            .order_by(TaskInstance.id)
            .with_for_update()
        ).all()
        if map_indexes:
            tis = [t for t in tis if t.task_id != task_id or t.map_index in map_indexes]
            found = {t.map_index for t in tis if t.task_id == task_id}
            missing = sorted(set(map_indexes) - found)
            if missing:
                raise ActionError(
                    f"task {task_id!r} of run {run_id!r} has no map index {missing[0]}",
                    not_found=True,
                )
        changed: list[tuple[str, str]] = []
        refused: list[str] = []
        for ti in tis:
            label = ti_label(ti.task_id, ti.map_index)
            if change(session, ti, dag.task_dict.get(ti.task_id)):
                changed.append((label, ti.state))
            else:
                refused.append(f"{label} ({ti.state})")
        transitions.reopen_dag_run(session, run)
    return UserChanges(changed, refused)


def clear_change(session: Session, ti: TaskInstance, task: GraphTask | None) -> bool:
    """Run the task instance again, as a new try with its task's retries."""
    return transitions.clear(session, ti, retries=task.retries if task else 0)


def mark_change(to_state: str) -> Change:
    """Set a task instance's state to ``to_state`` (one of MARKABLE_STATES)."""
    if to_state not in MARKABLE_STATES:
        allowed = ", ".join(MARKABLE_STATES)
        raise ActionError(f"a task can be marked {allowed}, not {to_state!r}")
    state = TaskState(to_state)

    def mark(session: Session, ti: TaskInstance, task: GraphTask | None) -> bool:
        return transitions.mark(session, ti, state)

    return mark
