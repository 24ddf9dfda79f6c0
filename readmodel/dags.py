"""DAGs as the web UI and the CLI show them: every DAG with its latest runs, and one DAG's
grid (runs by tasks) and the shape of its graph. What a DAG holds is read from the documents
the schedulers store after each parse (``deferral.store.serialized_dags``): no DAG file is
imported here (DECISIONS.md 5)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, load_only

from deferral.exceptions import ActionError
from deferral.states import TaskState
from deferral.store.serialized_dags import (
    NOT_PARSED,
    DagSummary,
    StoredDag,
    StoredParam,
    StoredTask,
    parsed_yet,
    read_dag,
    read_dag_to_change,
    read_summaries,
)
from deferral.store.tables import Dag, DagImportError, DagRun, TaskInstance
from readmodel.errors import NotFound
from readmodel.records import run_record

Record = dict[str, Any]

# Runs shown per DAG in the DAGs list.
RECENT_RUNS = 10
# The graph is drawn for DAGs of at most this many tasks (a bigger one is read in its grid).
MAX_GRAPH_TASKS = 300


# How a cell of several map indexes is shown: the first of these states that one of them is in.
_SUMMARY_ORDER = (
    TaskState.RUNNING,
    TaskState.DEFERRED,
    TaskState.AWAITING_INPUT,
    TaskState.QUEUED,
    TaskState.SCHEDULED,
    TaskState.UP_FOR_RETRY,
    TaskState.UP_FOR_RESCHEDULE,
    TaskState.FAILED,
    TaskState.UPSTREAM_FAILED,
    TaskState.NONE,
    TaskState.SKIPPED,
    TaskState.SUCCESS,
    TaskState.REMOVED,
)


def not_parsed_notice(session: Session) -> str | None:
    """NOT_PARSED while no scheduler has recorded a parse of a DAGs folder, else None."""
    return None if parsed_yet(session) else NOT_PARSED


def not_found(session: Session, dag_id: str, folder: object) -> str:
    """The one line for a DAG no parse found: and why, when nothing was parsed yet."""
    unparsed = not_parsed_notice(session)
    return f"DAG {dag_id!r} not found in {folder}" + (f" ({unparsed})" if unparsed else "")


def dag_to_change(session: Session, dag_id: str, folder: object) -> StoredDag:
    """The parsed document of the DAG a trigger, a pause, a clear or a mark acts on (no DAG
    file is imported); ActionError (not found) naming it."""
    dag = read_dag_to_change(session, dag_id)
    if dag is None:
        raise ActionError(not_found(session, dag_id, folder), not_found=True)
    return dag


def import_errors(session: Session) -> list[Record]:
    """The files that failed to import at the last parse, by file."""
    return [
        {"file": filename, "error": error}
        for filename, error in session.execute(
            select(DagImportError.filename, DagImportError.error).order_by(DagImportError.filename)
        )
    ]


# -- DAGs ----------------------------------------------------------------------------------------


def dags_overview(session: Session, tags: Sequence[str] = (), search: str = "") -> Record:
    """Every DAG (parsed, or only in the database) with its tags, schedule, next run, paused,
    tasks, its latest runs' states; only those with one of ``tags`` if given (as
    ``deferral dags list --tags``) and whose id or display name holds ``search`` (any case);
    and the files that fail to import; ``notice`` says when no DAGs were parsed yet."""
    parsed = read_summaries(session)
    rows = {row.dag_id: row for row in session.scalars(select(Dag))}
    dag_ids = sorted(set(parsed) | {d for d, row in rows.items() if row.is_active})

    def tags_of(dag_id: str) -> list[str]:
        dag, row = parsed.get(dag_id), rows.get(dag_id)
        return list(dag.tags) if dag is not None else list(row.tags) if row is not None else []

    if tags:
        dag_ids = [dag_id for dag_id in dag_ids if set(tags) & set(tags_of(dag_id))]
    if wanted := search.strip().casefold():
        dag_ids = [
            dag_id
            for dag_id in dag_ids
            if wanted in dag_id.casefold()
            or wanted in (_display_name(parsed.get(dag_id)) or "").casefold()
        ]
    recent = _recent_runs(session, dag_ids, RECENT_RUNS)
    records = []
    for dag_id in dag_ids:
        dag, row = parsed.get(dag_id), rows.get(dag_id)
        scheduled = dag is not None and row is not None
        records.append(
            {
                "dag_id": dag_id,
                "display_name": _display_name(dag),
                "tags": tags_of(dag_id),
                "loaded": dag is not None,
                "schedule": dag.schedule if dag is not None else row and row.schedule,
                "is_paused": _is_paused(dag, row),
                # As the scheduler last moved it on (the dag row).
                "next_run": row.next_dagrun if scheduled and row else None,
                "next_run_after": row.next_dagrun_create_after if scheduled and row else None,
                "tasks": dag.task_count if dag is not None else None,
                "fileloc": dag.fileloc if dag is not None else row and row.fileloc,
                "recent_runs": recent.get(dag_id, []),
                "missing_reason": row.missing_reason if row is not None else None,
            }
        )
    return {
        "dags": records,
        "import_errors": import_errors(session),
        "tags": list(tags),
        "search": search,
        "notice": not_parsed_notice(session),
    }


def _is_paused(dag: DagSummary | StoredDag | None, row: Dag | None) -> bool:
    return _paused(dag, row.is_paused if row is not None else None)


def _paused(dag: DagSummary | StoredDag | None, recorded: bool | None) -> bool:
    if recorded is not None:
        return bool(recorded)
    # Before a scheduler has recorded the DAG, what it will be created with.
    return bool(dag is not None and dag.is_paused_upon_creation)


def wanted_tags(given: Sequence[str]) -> list[str]:
    """The tags a DAG list is filtered by: each one given, or comma-separated ones."""
    return sorted({tag.strip() for value in given for tag in value.split(",") if tag.strip()})


def dag_list(session: Session, tags: Collection[str] = ()) -> list[Record]:
    """The parsed DAGs as ``deferral dags list`` gives them: schedule, paused (as the DAGs page
    says it), tasks, file and tags; only those with one of ``tags`` if given."""
    recorded = {
        row.dag_id: row.is_paused for row in session.execute(select(Dag.dag_id, Dag.is_paused))
    }
    return [
        {
            "dag_id": dag_id,
            "schedule": dag.schedule,
            "is_paused": _paused(dag, recorded.get(dag_id)),
            "tasks": dag.task_count,
            "fileloc": dag.fileloc,
            "tags": list(dag.tags),
        }
        for dag_id, dag in sorted(read_summaries(session).items())
        if not tags or set(tags) & set(dag.tags)
    ]


# Each DAG's latest :limit runs, newest first: one walk of the (dag_id, logical_date) key
# backwards per DAG (a window over every run of each DAG read 100,000 rows for a DAG with that
# many runs waiting).
_RECENT_RUNS_SQL = text(
    """
    SELECT d.dag_id, r.run_id, r.state, r.logical_date
    FROM unnest(CAST(:dag_ids AS text[])) AS d (dag_id)
    CROSS JOIN LATERAL (
        SELECT run_id, state, logical_date FROM dag_run
        WHERE dag_run.dag_id = d.dag_id
        ORDER BY logical_date DESC, id DESC
        LIMIT :limit
    ) AS r
    """
)


def _recent_runs(session: Session, dag_ids: Sequence[str], limit: int) -> dict[str, list[Record]]:
    """Each DAG's latest ``limit`` runs, newest first."""
    if not dag_ids:
        return {}
    found: dict[str, list[Record]] = {}
    for row in session.execute(_RECENT_RUNS_SQL, {"dag_ids": list(dag_ids), "limit": limit}):
        found.setdefault(row.dag_id, []).append(
            {"run_id": row.run_id, "state": row.state, "logical_date": row.logical_date}
        )
    return found


# -- one DAG: grid and graph ---------------------------------------------------------------------


@dataclass(frozen=True)
class GraphShape:
    """What a DAG's graph is drawn from: its tasks upstream first (none when it has more than
    MAX_GRAPH_TASKS), what each depends on, the collapsed group each task is drawn in, and the
    labels of its edges; and the params its trigger form is built from."""

    tasks: list[str]
    upstream: dict[str, list[str]]
    collapsed_into: dict[str, str]
    edge_labels: dict[tuple[str, str], str]
    params: list[StoredParam]


def dag_detail(
    session: Session,
    dag_id: str,
    runs: int,
    selected_run: str | None,
    per_page: int,
    task_page: int = 1,
    collapsed: Collection[str] = (),
) -> tuple[Record, GraphShape]:
    """A DAG's latest ``runs`` runs (oldest first) by one page of ``per_page`` of its tasks,
    each cell the state of that task in that run (a mapped task is one row, its map indexes
    counted by state); and its graph's states, coloured by the selected run (default the
    latest), the task groups named in ``collapsed`` counted as one box each, with the shape the
    graph is drawn from. Reads only the columns it shows: never a run's conf."""
    dag = read_dag(session, dag_id)
    row = session.get(Dag, dag_id)
    found_runs = list(
        reversed(
            session.scalars(
                select(DagRun)
                .options(load_only(*_RUN_COLUMNS))
                .where(DagRun.dag_id == dag_id)
                .order_by(DagRun.logical_date.desc(), DagRun.id.desc())
                .limit(runs)
            ).all()
        )
    )
    if dag is None and row is None and not found_runs:
        raise NotFound(
            f"DAG {dag_id!r} not found" + (f" ({NOT_PARSED})" if not parsed_yet(session) else "")
        )
    run_ids = [run.run_id for run in found_runs]
    seen = session.scalars(
        select(TaskInstance.task_id)
        .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id.in_(run_ids))
        .distinct()
    ).all()
    order, upstream = _task_order(dag, seen)
    if selected_run is None or selected_run not in run_ids:
        selected_run = run_ids[-1] if run_ids else None
    pages = max(1, -(-len(order) // per_page))
    if task_page > pages:
        raise NotFound(f"DAG {dag_id!r} has {pages} page(s) of tasks, not {task_page}")
    shown = order[(task_page - 1) * per_page : task_page * per_page]
    cells = _cells(session, dag_id, run_ids, shown)
    in_dag = dag.task_dict if dag is not None else {}
    tasks = [
        {
            "task_id": task_id,
            "upstream": sorted(upstream.get(task_id, ())),
            "operator": operator_name(dag, task_id),
            "is_mapped": task_id in in_dag and in_dag[task_id].is_mapped,
            "role": _role(in_dag.get(task_id)),
            "cells": [cells.get((task_id, run_id), _NO_CELL) for run_id in run_ids],
        }
        for task_id in shown
    ]
    drawn = len(order) <= MAX_GRAPH_TASKS
    groups = {task.task_id: task.groups for task in in_dag.values()}
    into = _collapsed_into(groups, set(collapsed))
    labels = {(up, down): label for up, down, label in (dag.edge_labels if dag else ())}
    selected = (
        {task: cell for (task, _), cell in _cells(session, dag_id, [selected_run], order).items()}
        if drawn and selected_run is not None
        else {}
    )
    record = {
        "dag_id": dag_id,
        "display_name": _display_name(dag),
        # Airflow's owner_links: each task owner named there links to its page.
        "owner_links": dict(dag.owner_links) if dag is not None else {},
        "owners": list(dag.owners) if dag is not None else [],
        "loaded": dag is not None,
        "schedule": dag.schedule if dag is not None else row and row.schedule,
        "is_paused": _is_paused(dag, row),
        "fileloc": dag.fileloc if dag is not None else row and row.fileloc,
        "params": {param.name: param.value for param in dag.params} if dag is not None else {},
        "doc_md": dag.doc_md if dag is not None else None,
        "missing_reason": row.missing_reason if row is not None else None,
        "runs": [run_record(run) for run in found_runs],
        "runs_shown": runs,
        "tasks": tasks,
        # Setup and teardown tasks of the graph, marked as the grid marks them.
        "roles": {t: role for t in order if (role := _role(in_dag.get(t))) is not None},
        "task_count": len(order),
        "task_page": task_page,
        "task_pages": pages,
        "first_task": (task_page - 1) * per_page + 1 if shown else 0,
        "selected_run": selected_run,
        "graph": {
            "drawn": drawn,
            "states": {
                task_id: selected.get(task_id, _NO_CELL)["state"]
                for task_id in (order if drawn else [])
            },
            # A collapsed group's box shows the most pressing state of its tasks.
            "group_states": {
                group_id: _most_pressing(
                    [
                        selected.get(task_id, _NO_CELL)["state"]
                        for task_id, group in into.items()
                        if group == group_id
                    ]
                )
                for group_id in (sorted(set(into.values())) if drawn else [])
            },
            "labels": {t.task_id: t.display_name for t in in_dag.values() if t.display_name},
            "groups": [
                {
                    "group_id": group_id,
                    "tasks": sum(group_id in chain for chain in groups.values()),
                    "collapsed": group_id in collapsed,
                }
                for group_id in sorted({g for chain in groups.values() for g in chain})
            ],
        },
    }
    params = list(dag.params) if dag is not None else []
    return record, GraphShape(order if drawn else [], upstream, into, labels, params)


# What a grid shows of a run (run_record's fields): never its conf.
_RUN_COLUMNS = (
    DagRun.id,
    DagRun.dag_id,
    DagRun.run_id,
    DagRun.run_type,
    DagRun.state,
    DagRun.logical_date,
    DagRun.data_interval_start,
    DagRun.data_interval_end,
    DagRun.start_date,
    DagRun.end_date,
)
_NO_CELL: Record = {"state": None, "try_number": None, "map_indexes": 0, "counts": {}}


def _cells(
    session: Session, dag_id: str, run_ids: Sequence[str], task_ids: Sequence[str]
) -> dict[tuple[str, str], Record]:
    """Each (task, run) cell of ``task_ids`` in ``run_ids``: counted in the database, so a task
    mapped into thousands of instances is a handful of rows."""
    ti = TaskInstance
    counts: dict[tuple[str, str], Counter[str]] = {}
    tries: dict[tuple[str, str], int] = {}
    mapped: set[tuple[str, str]] = set()
    if not run_ids or not task_ids:
        return {}
    for found in session.execute(
        select(
            ti.task_id,
            ti.run_id,
            ti.state,
            func.count().label("n"),
            func.max(ti.try_number).label("try_number"),
            func.max(ti.map_index).label("map_index"),
        )
        .where(ti.dag_id == dag_id, ti.run_id.in_(run_ids), ti.task_id.in_(task_ids))
        .group_by(ti.task_id, ti.run_id, ti.state)
    ):
        key = (found.task_id, found.run_id)
        counts.setdefault(key, Counter())[found.state] = found.n
        tries[key] = max(tries.get(key, 0), found.try_number)
        if found.map_index >= 0:
            mapped.add(key)
    return {key: _cell(counted, tries[key], key in mapped) for key, counted in counts.items()}


def _role(task: StoredTask | None) -> str | None:
    """ "setup", "teardown" or None: how the grid marks a setup or teardown task."""
    if task is None:
        return None
    return "setup" if task.is_setup else "teardown" if task.is_teardown else None


def operator_name(dag: StoredDag | None, task_id: str) -> str | None:
    task = dag.task_dict.get(task_id) if dag is not None else None
    return task.operator if task is not None else None


def _task_order(
    dag: StoredDag | None, seen_task_ids: Iterable[str]
) -> tuple[list[str], dict[str, list[str]]]:
    """The DAG's tasks upstream first, then tasks only its runs still have (removed from the
    file since), and what each depends on."""
    tasks = dag.tasks if dag is not None else []
    in_dag = {task.task_id for task in tasks}
    order = [task.task_id for task in tasks]
    upstream = {task.task_id: list(task.upstream) for task in tasks}
    return [*order, *sorted(t for t in set(seen_task_ids) if t not in in_dag)], upstream


def _display_name(dag: DagSummary | StoredDag | None) -> str | None:
    """The DAG's ``dag_display_name`` when it gives one other than its id."""
    return dag.display_name if dag is not None else None


def _collapsed_into(groups: Mapping[str, list[str]], collapsed: set[str]) -> dict[str, str]:
    """Task -> the outermost collapsed group it is in (tasks in none are left out)."""
    into = {}
    for task_id, chain in groups.items():
        outermost = next((group for group in chain if group in collapsed), None)
        if outermost is not None:
            into[task_id] = outermost
    return into


def _most_pressing(states: Sequence[str]) -> str:
    counts = Counter(states)
    return next((s for s in _SUMMARY_ORDER if counts.get(s)), "none")


def _cell(counts: Counter[str], try_number: int, mapped: bool) -> Record:
    """One task in one run: its state (for several map indexes, the most pressing one and how
    many are in each state) and its latest try."""
    state = next((s for s in _SUMMARY_ORDER if counts.get(s)), next(iter(counts)))
    return {
        "state": str(state),
        "try_number": try_number,
        "map_indexes": sum(counts.values()) if mapped else 0,
        "counts": dict(sorted(counts.items())),
    }
