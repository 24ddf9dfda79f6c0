"""What the pages and the JSON API show, read from Postgres (and Redis): one function per page,
each returning plain data (dicts, lists, strings, numbers, datetimes) that a template renders
and the API encodes as it is. Never a secret: trigger kwargs, resume kwargs, Variables and
Connections are not read at all; values users wrote (run conf, XComs, rendered fields) are
passed through the secrets masker.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, load_only

from broker import deadletters
from broker.client import Broker
from deferral.authoring.schedules import latest_automated_intervals
from deferral.dag import DAG
from deferral.exceptions import DagDefinitionError
from deferral.loading.dagbag import DagBag
from deferral.loading.parsing import FolderParser, Parsed
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.secrets_masker import redact
from deferral.states import FINISHED_STATES, TaskState
from deferral.store import doctor as checklist
from deferral.store import liveness, tasklogs
from deferral.store.actions import ti_label
from deferral.store.stored_secrets import known_secrets, shown_xcom
from deferral.store.tables import (
    Dag,
    DagRun,
    RenderedTaskInstanceFields,
    TaskInstance,
    TaskStateChange,
    Trigger,
    Triggerer,
    Worker,
    XCom,
)
from readmodel.doctor import gather_checks
from readmodel.explain import explain
from readmodel.records import (
    find_run,
    process_records,
    run_record,
    task_instances,
    triggerer_own,
    worker_own,
)
from readmodel.streams import stream_records
from readmodel.waits import how_to_resume, row_wait_of, signal_key
from webserver.layout import layout
from webserver.paramform import fields

Record = dict[str, Any]

# Runs shown per DAG on the DAGs page, and by default in a DAG's grid (at most MAX_GRID_RUNS).
RECENT_RUNS = 10
GRID_RUNS = 12
MAX_GRID_RUNS = 100
# A grid page shows at most this many cells (runs x tasks): a DAG of thousands of tasks is
# paged by its tasks, MAX_GRID_ROWS at most a page, fewer the more runs are shown.
MAX_GRID_CELLS = 1200
MAX_GRID_ROWS = 100
MIN_GRID_ROWS = 10
# The graph is drawn for DAGs of at most this many tasks (a bigger one is read in its grid).
MAX_GRAPH_TASKS = 300
# The Deferred page lists at most this many task instances, the first deferred rows by id (the
# oldest task instances), and counts them up to MAX_DEFERRED_COUNTED: with a million waiting, a
# count of all and a sort of all by their wait cost the page seconds.
MAX_DEFERRED_LISTED = 2000
MAX_DEFERRED_COUNTED = 100_000
# A deferral is "close to expiry" in the last fifth of its wait, and always in its last 5 min.
EXPIRY_SOON_FRACTION = 0.2
EXPIRY_SOON_CAP_SEC = 300.0
# Dead-letter entries shown, newest first, and the fields shown of each (never a token or mac).
DEAD_LETTERS_SHOWN = 20
DEAD_LETTER_FIELDS = (
    "source_stream",
    "source_id",
    "error",
    "deliveries",
    "task",
    "consumer",
)
# A page shows at most this many lines of a try's log (the API pages through all of them).
LOG_LINES_SHOWN = 5000
# What a DAG search may hold (a search is a substring of an id, at most 250 characters).
MAX_SEARCH_LENGTH = 250
# The DAGs folder is scanned again at most this often (a file's DAGs are re-imported only when
# its mtime changed).
DAG_RESCAN_SEC = 5.0
# The longest a page waits for a read of the DAGs folder it started.
PARSE_WAIT_SEC = 5.0

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


# A try has ended once its task instance is finished or waits for its next try.
_TRY_ENDED = frozenset({*FINISHED_STATES, TaskState.UP_FOR_RETRY})


class NotFound(LookupError):
    """What a page or API call names does not exist; the message says what."""


class DagSource:
    """The DAGs folder as this process sees it, read again at most every DAG_RESCAN_SEC through
    a ``FolderParser`` (a parse child imports each changed file first, within the import
    timeout, and a thread of its own then loads it): a page waits for that read at most
    PARSE_WAIT_SEC, then shows the last one, so no DAG file can hang the web UI."""

    def __init__(self, folder: Any, import_timeout: float) -> None:
        self._parser = FolderParser(DagBag(folder), import_timeout)
        self._lock = threading.Lock()
        self._scanned_at: float | None = None
        self._parsed: Parsed | None = None
        self._folder_error: str | None = None
        # Each DAG's task order, kept while the DagBag keeps the same DAG object (sorting
        # thousands of tasks at every refresh of a page would cost more than its queries).
        self._orders: dict[str, tuple[DAG, list[str], dict[str, list[str]]]] = {}

    def bag(self) -> tuple[dict[str, DAG], dict[str, str]]:
        """The DAGs by id and the import errors by file."""
        with self._lock:
            now = time.monotonic()
            if self._scanned_at is None or now - self._scanned_at >= DAG_RESCAN_SEC:
                self._scanned_at = now
                folder = self._parser.bag.folder
                if folder.is_dir():
                    self._folder_error = None
                    self._parser.start()
                    self._parser.wait(PARSE_WAIT_SEC)
                else:
                    self._folder_error = f"DAGs folder {folder} does not exist"
            finished = self._parser.take()
            self._parsed = finished or self._parsed
            dags = dict(self._parsed.dags) if self._parsed is not None else {}
            errors = dict(self._parsed.import_errors) if self._parsed is not None else {}
            if self._folder_error is not None:
                errors[str(self._parser.bag.folder)] = self._folder_error
            return dags, errors

    def dag(self, dag_id: str) -> DAG | None:
        return self.bag()[0].get(dag_id)

    def task_order(self, dag: DAG) -> tuple[list[str], dict[str, list[str]]]:
        """``dag``'s task ids upstream first, and what each depends on."""
        cached = self._orders.get(dag.dag_id)
        if cached is None or cached[0] is not dag:
            cached = (dag, *_dag_order(dag))
            self._orders[dag.dag_id] = cached
        return cached[1], cached[2]


def _db_now(session: Session) -> dt.datetime:
    now: dt.datetime = session.scalars(select(func.now())).one()
    return now


# -- DAGs ----------------------------------------------------------------------------------------


def wanted_tags(given: Sequence[str]) -> list[str]:
    """The tags a DAG list is filtered by: each ``tags`` parameter, or comma-separated ones."""
    return sorted({tag.strip() for value in given for tag in value.split(",") if tag.strip()})


def dags_overview(
    session: Session, source: DagSource, tags: Sequence[str] = (), search: str = ""
) -> Record:
    """Every DAG (in the folder, or only in the database) with its tags, schedule, next run,
    paused, tasks, its latest runs' states; only those with one of ``tags`` if given (as
    ``deferral dags list --tags``) and whose id or display name holds ``search`` (any case);
    and the files that fail to import."""
    dags, import_errors = source.bag()
    rows = {row.dag_id: row for row in session.scalars(select(Dag))}
    dag_ids = sorted(set(dags) | {d for d, row in rows.items() if row.is_active})

    def tags_of(dag_id: str) -> list[str]:
        dag, row = dags.get(dag_id), rows.get(dag_id)
        return list(dag.tags) if dag is not None else list(row.tags) if row is not None else []

    if tags:
        dag_ids = [dag_id for dag_id in dag_ids if set(tags) & set(tags_of(dag_id))]
    if wanted := search.strip().casefold():
        dag_ids = [
            dag_id
            for dag_id in dag_ids
            if wanted in dag_id.casefold()
            or wanted in (_display_name(dags.get(dag_id)) or "").casefold()
        ]
    now = _db_now(session)
    latest = latest_automated_intervals(session, [d for d in dag_ids if d in dags])
    recent = _recent_runs(session, dag_ids, RECENT_RUNS)
    records = []
    for dag_id in dag_ids:
        dag, row = dags.get(dag_id), rows.get(dag_id)
        info = dag.next_dagrun_info(latest.get(dag_id), now=now) if dag is not None else None
        records.append(
            {
                "dag_id": dag_id,
                "display_name": _display_name(dag),
                "tags": tags_of(dag_id),
                "loaded": dag is not None,
                "schedule": dag.timetable.summary if dag is not None else row and row.schedule,
                "is_paused": _is_paused(dag, row),
                "next_run": info.logical_date if info is not None else None,
                "next_run_after": info.run_after if info is not None else None,
                "tasks": len(dag.tasks) if dag is not None else None,
                "fileloc": str(dag.fileloc) if dag is not None else row and row.fileloc,
                "recent_runs": recent.get(dag_id, []),
                "missing_reason": row.missing_reason if row is not None else None,
            }
        )
    errors = [{"file": path, "error": error} for path, error in sorted(import_errors.items())]
    return {"dags": records, "import_errors": errors, "tags": list(tags), "search": search}


def _is_paused(dag: DAG | None, row: Dag | None) -> bool:
    if row is not None:
        return bool(row.is_paused)
    # Before a scheduler has recorded the DAG, what it will be created with.
    return bool(dag is not None and dag.is_paused_upon_creation)


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


def grid_rows(runs: int) -> int:
    """How many tasks a grid page of ``runs`` runs shows."""
    return max(MIN_GRID_ROWS, min(MAX_GRID_ROWS, MAX_GRID_CELLS // max(1, runs)))


def dag_detail(
    session: Session,
    source: DagSource,
    dag_id: str,
    runs: int,
    selected_run: str | None,
    task_page: int = 1,
    collapsed: Collection[str] = (),
) -> Record:
    """A DAG's latest ``runs`` runs (oldest first) by one page of its tasks, each cell the state
    of that task in that run (a mapped task is one row, its map indexes counted by state); and
    the graph of its tasks (up to MAX_GRAPH_TASKS), coloured by the selected run (default the
    latest), the task groups named in ``collapsed`` drawn as one box each. Reads only the
    columns it shows: never a run's conf."""
    dag = source.dag(dag_id)
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
        raise NotFound(f"DAG {dag_id!r} not found")
    run_ids = [run.run_id for run in found_runs]
    seen = session.scalars(
        select(TaskInstance.task_id)
        .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id.in_(run_ids))
        .distinct()
    ).all()
    order, upstream = _task_order(source, dag, seen)
    if selected_run is None or selected_run not in run_ids:
        selected_run = run_ids[-1] if run_ids else None
    per_page = grid_rows(runs)
    pages = max(1, -(-len(order) // per_page))
    if task_page > pages:
        raise NotFound(f"DAG {dag_id!r} has {pages} page(s) of tasks, not {task_page}")
    shown = order[(task_page - 1) * per_page : task_page * per_page]
    cells = _cells(session, dag_id, run_ids, shown)
    tasks = [
        {
            "task_id": task_id,
            "upstream": sorted(upstream.get(task_id, ())),
            "operator": _operator_name(dag, task_id),
            "is_mapped": _mapped(dag, task_id),
            "role": _role(dag, task_id),
            "cells": [cells.get((task_id, run_id), _NO_CELL) for run_id in run_ids],
        }
        for task_id in shown
    ]
    drawn = len(order) <= MAX_GRAPH_TASKS
    groups = _groups_of(dag) if dag is not None else {}
    into = _collapsed_into(groups, set(collapsed))
    labels = {
        edge: str(info["label"])
        for edge, info in (dag.edge_info.items() if dag is not None else ())
        if info.get("label")
    }
    graph = layout(order if drawn else [], upstream, into, labels)
    selected = (
        {task: cell for (task, _), cell in _cells(session, dag_id, [selected_run], order).items()}
        if drawn and selected_run is not None
        else {}
    )
    return {
        "dag_id": dag_id,
        "display_name": _display_name(dag),
        # Airflow's owner_links: each task owner named there links to its page.
        "owner_links": dict(dag.owner_links) if dag is not None else {},
        "owners": sorted({str(getattr(t, "owner", "")) for t in dag.tasks} - {""})
        if dag is not None
        else [],
        "loaded": dag is not None,
        "schedule": dag.timetable.summary if dag is not None else row and row.schedule,
        "is_paused": _is_paused(dag, row),
        "fileloc": str(dag.fileloc) if dag is not None else row and row.fileloc,
        "params": redact(dict(dag.params)) if dag is not None else {},
        "param_fields": [
            asdict(f) for f in (fields(dag.params, dag.param_specs) if dag is not None else [])
        ],
        "doc_md": dag.doc_md_text() if dag is not None else None,
        "missing_reason": row.missing_reason if row is not None else None,
        "runs": [run_record(run) for run in found_runs],
        "runs_shown": runs,
        "tasks": tasks,
        # Setup and teardown tasks of the graph, marked as the grid marks them.
        "roles": {t: role for t in order if (role := _role(dag, t)) is not None},
        "task_count": len(order),
        "task_page": task_page,
        "task_pages": pages,
        "first_task": (task_page - 1) * per_page + 1 if shown else 0,
        "selected_run": selected_run,
        "graph": {
            **asdict(graph),
            "drawn": drawn,
            "states": {
                task_id: selected.get(task_id, _NO_CELL)["state"]
                for task_id in (order if drawn else [])
            },
            # A collapsed group's box shows the most pressing state of its tasks.
            "group_states": {
                node.group: _most_pressing(
                    [
                        selected.get(task_id, _NO_CELL)["state"]
                        for task_id, group in into.items()
                        if group == node.group
                    ]
                )
                for node in graph.nodes
                if node.group is not None
            },
            "labels": _task_labels(dag),
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


def _mapped(dag: DAG | None, task_id: str) -> bool:
    task = dag.task_dict.get(task_id) if dag is not None else None
    return bool(task is not None and task.is_mapped)


def _role(dag: DAG | None, task_id: str) -> str | None:
    """ "setup", "teardown" or None: how the grid marks a setup or teardown task."""
    task = dag.task_dict.get(task_id) if dag is not None else None
    if task is None:
        return None
    return "setup" if task.is_setup else "teardown" if task.is_teardown else None


def _operator_name(dag: DAG | None, task_id: str) -> str | None:
    task = dag.task_dict.get(task_id) if dag is not None else None
    return type(task).__name__ if task is not None else None


def _task_order(
    source: DagSource, dag: DAG | None, seen_task_ids: Iterable[str]
) -> tuple[list[str], dict[str, list[str]]]:
    """The DAG's tasks upstream first, then tasks only its runs still have (removed from the
    file since), and what each depends on."""
    order, upstream = source.task_order(dag) if dag is not None else ([], {})
    in_dag = dag.task_dict if dag is not None else {}
    return [*order, *sorted(t for t in set(seen_task_ids) if t not in in_dag)], upstream


def _display_name(dag: DAG | None) -> str | None:
    """The DAG's ``dag_display_name`` when it gives one other than its id."""
    if dag is None or dag.dag_display_name == dag.dag_id:
        return None
    return str(dag.dag_display_name)


def _task_labels(dag: DAG | None) -> dict[str, str]:
    """The tasks' ``task_display_name``s, where one is given."""
    if dag is None:
        return {}
    named = {t.task_id: getattr(t, "task_display_name", None) for t in dag.tasks}
    return {task_id: str(name) for task_id, name in named.items() if name}


def _groups_of(dag: DAG) -> dict[str, list[str]]:
    """Each task's task groups, outermost first (none: not in a group)."""
    chains: dict[str, list[str]] = {}
    for task_id, task in dag.task_dict.items():
        chain: list[str] = []
        group = task.task_group
        while group is not None:
            chain.insert(0, group.group_id)
            group = group.parent_group
        chains[task_id] = chain
    return chains


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


def _dag_order(dag: DAG) -> tuple[list[str], dict[str, list[str]]]:
    order: list[str] = []
    upstream: dict[str, list[str]] = {}
    try:
        for task in dag.topological_order():
            order.append(task.task_id)
            upstream[task.task_id] = sorted(task.upstream_task_ids)
    except DagDefinitionError:
        order = sorted(dag.task_dict)
    return order, upstream


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


# -- a task instance -----------------------------------------------------------------------------


def task_instance_detail(
    session: Session,
    settings: Settings,
    source: DagSource,
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int | None,
    try_number: int | None = None,
) -> Record:
    """One task instance: what it is, why it is in its state, its state history with durations,
    what it waits on if deferred, its rendered fields, XComs, and the log of try ``try_number``
    (default: the latest) with the tries that have one. For a mapped task without
    ``map_index``: its map indexes to choose from."""
    run = find_run(session, dag_id, run_id)
    if run is None:
        raise NotFound(f"DAG {dag_id!r} has no run {run_id!r}")
    tis = task_instances(session, dag_id, run_id, task_id)
    dag = source.dag(dag_id)
    if not tis and (dag is None or task_id not in dag.task_dict):
        raise NotFound(f"run {run_id!r} of DAG {dag_id!r} has no task {task_id!r}")
    base = {
        "dag_id": dag_id,
        "run_id": run_id,
        "task_id": task_id,
        "run": {**run_record(run), "conf": redact(dict(run.conf or {}))},
        "operator": _operator_name(dag, task_id),
        "map_indexes": [
            {"map_index": ti.map_index, "state": ti.state, "try_number": ti.try_number}
            for ti in tis
            if ti.map_index >= 0
        ],
    }
    if map_index is None and len(tis) == 1:
        map_index = tis[0].map_index
    ti = next((t for t in tis if t.map_index == map_index), None)
    if ti is None:
        if map_index is not None and tis:
            raise NotFound(f"task {task_id!r} of run {run_id!r} has no map index {map_index}")
        return {**base, "map_index": map_index, "task_instance": None}
    now = _db_now(session)
    return {
        **base,
        "log": _log(session, ti, try_number),
        "map_index": ti.map_index,
        "label": ti_label(ti.task_id, ti.map_index),
        "task_instance": {
            "id": ti.id,
            "state": ti.state,
            "try_number": ti.try_number,
            "max_tries": ti.max_tries,
            "finished": ti.state in FINISHED_STATES,
            "hostname": ti.hostname,
            "worker": ti.worker,
            "queue": ti.queue,
            "pool": ti.pool,
            "priority_weight": ti.priority_weight,
            "queued_at": ti.queued_at,
            "start_date": ti.start_date,
            "end_date": ti.end_date,
            "duration_sec": _seconds(ti.start_date, ti.end_date or now) if ti.start_date else None,
        },
        "explain": [line.strip() for line in explain(session, settings, dag, run, ti)[1:]],
        "history": _history(session, ti.id, now),
        "deferred": _deferral(session, settings, ti, now),
        "rendered": _rendered(session, ti.id),
        "xcoms": [
            {"key": key, "value": shown_xcom(masker, key, value)}
            for masker in [known_secrets(session, Cipher(settings.fernet_keys))]
            for key, value in session.execute(
                select(XCom.key, XCom.value)
                .where(XCom.task_instance_id == ti.id)
                .order_by(XCom.key)
            )
        ],
    }


def _log(session: Session, ti: TaskInstance, try_number: int | None) -> Record:
    """The tries with a log, and the first LOG_LINES_SHOWN lines of one of them."""
    tries = tasklogs.tries_with_logs(session, ti.id)
    if ti.try_number > 0 and ti.try_number not in tries:
        tries.append(ti.try_number)  # the current try, whose lines may be on their way
    shown = try_number if try_number is not None else (tries[-1] if tries else None)
    if shown is not None and shown not in tries:
        raise NotFound(f"{ti_label(ti.task_id, ti.map_index)} has no try {shown}")
    lines = (
        [] if shown is None else log_lines(session, ti, shown, after_id=0, limit=LOG_LINES_SHOWN)
    )
    return {
        "tries": tries,
        "try_number": shown,
        "lines": lines,
        "complete": len(lines) < LOG_LINES_SHOWN,
        "over": shown is None or try_over(ti, shown),
    }


def log_lines(
    session: Session, ti: TaskInstance, try_number: int, *, after_id: int, limit: int
) -> list[Record]:
    """Lines of one try's log after ``after_id`` (masked again with this process's secrets)."""
    return [
        {**asdict(line), "text": redact(line.text)}
        for line in tasklogs.read_lines(session, ti.id, try_number, after_id, limit)
    ]


def try_over(ti: TaskInstance, try_number: int) -> bool:
    """Whether try ``try_number`` has ended: no more lines are coming."""
    return try_number < ti.try_number or ti.state in _TRY_ENDED


def task_log(
    session: Session,
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int,
    try_number: int,
    after_id: int,
    limit: int,
) -> Record:
    """Lines of one try's log after ``after_id``, and whether more may come (the log's tail)."""
    found = [
        t for t in task_instances(session, dag_id, run_id, task_id) if t.map_index == map_index
    ]
    if not found:
        label = ti_label(task_id, map_index)
        raise NotFound(f"run {run_id!r} of DAG {dag_id!r} has no task instance {label}")
    ti = found[0]
    return {
        "try_number": try_number,
        "lines": log_lines(session, ti, try_number, after_id=after_id, limit=limit),
        "finished": try_over(ti, try_number),
    }


def _seconds(start: dt.datetime, end: dt.datetime) -> float:
    return round(max(0.0, (end - start).total_seconds()), 3)


def _history(session: Session, ti_id: int, now: dt.datetime) -> list[Record]:
    """Each recorded state change and how long the state it entered lasted (the latest, if
    unfinished: until now)."""
    changes = session.scalars(
        select(TaskStateChange)
        .where(TaskStateChange.task_instance_id == ti_id)
        .order_by(TaskStateChange.id)
    ).all()
    records = []
    for position, change in enumerate(changes):
        ended = changes[position + 1].at if position + 1 < len(changes) else None
        # A finished state lasts for good: only an unfinished current one has lasted "so far".
        open_ended = ended is None and change.to_state in FINISHED_STATES
        records.append(
            {
                "from_state": change.from_state,
                "to_state": change.to_state,
                "at": change.at,
                "reason": change.reason,
                "lasted_sec": None if open_ended else _seconds(change.at, ended or now),
                "current": ended is None and not open_ended,
            }
        )
    return records


def _deferral(
    session: Session, settings: Settings, ti: TaskInstance, now: dt.datetime
) -> Record | None:
    """What a deferred task waits on: its trigger's class, the triggerer running it, since
    when, its timeout. Never the trigger's kwargs."""
    if ti.state != TaskState.DEFERRED:
        return None
    trigger = session.execute(
        select(Trigger.id, Trigger.classpath, Trigger.triggerer_id, Trigger.created_date).where(
            Trigger.id == ti.trigger_id
        )
    ).one_or_none()
    since = session.scalar(
        select(func.max(TaskStateChange.at)).where(
            TaskStateChange.task_instance_id == ti.id,
            TaskStateChange.to_state == TaskState.DEFERRED,
        )
    )
    triggerer = (
        session.get(Triggerer, trigger.triggerer_id)
        if trigger is not None and trigger.triggerer_id
        else None
    )
    row_wait = row_wait_of(trigger.classpath if trigger is not None else None)
    return {
        "trigger_id": ti.trigger_id,
        "classpath": trigger.classpath if trigger is not None else None,
        "row_wait": row_wait,
        "resumed_by": (
            None
            if row_wait is None
            else how_to_resume(
                row_wait, signal_key(session, ti.trigger_id) if row_wait == "signal" else None
            )
        ),
        "triggerer": trigger.triggerer_id if trigger is not None else None,
        "triggerer_alive": triggerer is not None
        and liveness.is_alive(
            triggerer.state, triggerer.latest_heartbeat, now, settings.heartbeat_sec
        ),
        "next_method": ti.next_method,
        **_wait(since, ti.trigger_timeout, now),
    }


def _wait(since: dt.datetime | None, timeout: dt.datetime | None, now: dt.datetime) -> Record:
    """How long a deferral has waited, how long it has left, and whether that is close."""
    left = None if timeout is None else round((timeout - now).total_seconds(), 1)
    return {
        "since": since,
        "waited_sec": None if since is None else _seconds(since, now),
        "timeout": timeout,
        "seconds_left": left,
        "urgency": expiry_urgency(since, timeout, now),
    }


def expiry_urgency(
    since: dt.datetime | None, timeout: dt.datetime | None, now: dt.datetime
) -> str | None:
    """ "expired" past the timeout, "soon" in the last fifth of the wait (at most its last
    EXPIRY_SOON_CAP_SEC), else None (also without a timeout)."""
    if timeout is None:
        return None
    left = (timeout - now).total_seconds()
    if left < 0:
        return "expired"
    whole = (timeout - since).total_seconds() if since is not None else EXPIRY_SOON_CAP_SEC
    return "soon" if left <= min(EXPIRY_SOON_CAP_SEC, EXPIRY_SOON_FRACTION * whole) else None


def _rendered(session: Session, ti_id: int) -> list[Record]:
    """The rendered template fields of each try, latest first (recorded masked)."""
    return [
        {"try_number": row.try_number, "rendered_at": row.rendered_at, "fields": row.rendered}
        for row in session.scalars(
            select(RenderedTaskInstanceFields)
            .where(RenderedTaskInstanceFields.task_instance_id == ti_id)
            .order_by(RenderedTaskInstanceFields.try_number.desc())
        )
    ]


# -- what waits now ------------------------------------------------------------------------------


def deferred_now(session: Session, settings: Settings) -> Record:
    """The deferred tasks, at most MAX_DEFERRED_LISTED of them (the oldest task instances, by
    ix_task_instance_state_id), grouped by trigger class and triggerer, the group waiting
    longest first and in each group the longest wait first; timeouts close to expiry flagged.
    They are counted up to MAX_DEFERRED_COUNTED (``total_capped`` says the count stopped)."""
    now = _db_now(session)
    ti = TaskInstance
    since = (
        select(func.max(TaskStateChange.at))
        .where(TaskStateChange.task_instance_id == ti.id, TaskStateChange.to_state == "deferred")
        .scalar_subquery()
        .label("since")
    )
    deferred = text("task_instance.state = 'deferred'")  # as ix_task_instance_state_id spells it
    counted = select(ti.id).where(deferred).limit(MAX_DEFERRED_COUNTED + 1).subquery()
    total = session.scalar(select(func.count()).select_from(counted)) or 0
    page = select(ti.id).where(deferred).order_by(ti.id).limit(MAX_DEFERRED_LISTED).subquery()
    rows = session.execute(
        select(
            ti.dag_id,
            ti.run_id,
            ti.task_id,
            ti.map_index,
            ti.trigger_id,
            ti.trigger_timeout,
            Trigger.classpath,
            Trigger.triggerer_id,
            since,
        )
        .join(page, page.c.id == ti.id)
        .outerjoin(Trigger, Trigger.id == ti.trigger_id)
        .order_by(since.asc().nulls_first(), ti.id)
    ).all()
    alive = {
        name
        for name, state, beat in session.execute(
            select(Triggerer.name, Triggerer.state, Triggerer.latest_heartbeat)
        )
        if liveness.is_alive(state, beat, now, settings.heartbeat_sec)
    }
    groups: dict[tuple[str | None, str | None], Record] = {}
    for row in rows:
        key = (row.classpath, row.triggerer_id)
        group = groups.setdefault(
            key,
            {
                "classpath": row.classpath,
                "row_wait": row_wait_of(row.classpath),
                "triggerer": row.triggerer_id,
                "triggerer_alive": row.triggerer_id in alive,
                "tasks": [],
            },
        )
        group["tasks"].append(
            {
                "dag_id": row.dag_id,
                "run_id": row.run_id,
                "task_id": row.task_id,
                "map_index": row.map_index,
                "label": ti_label(row.task_id, row.map_index),
                "trigger_id": row.trigger_id,
                **_wait(row.since, row.trigger_timeout, now),
            }
        )
    for group in groups.values():
        tasks = group["tasks"]
        group["count"] = len(tasks)
        group["oldest_since"] = tasks[0]["since"]
        group["soon"] = sum(1 for t in tasks if t["urgency"] is not None)
    return {
        "total": min(total, MAX_DEFERRED_COUNTED),
        "total_capped": total > MAX_DEFERRED_COUNTED,
        "listed": len(rows),
        "groups": list(groups.values()),  # rows came oldest first, so do the groups
    }


# -- processes, streams, doctor ------------------------------------------------------------------


def processes(session: Session, settings: Settings) -> Record:
    """Triggerers (capacity, load, heartbeat age, alive or stale) and workers, as the CLI's
    listings give them."""
    return {
        "triggerers": process_records(session, Triggerer, triggerer_own, settings.heartbeat_sec),
        "workers": process_records(session, Worker, worker_own, settings.heartbeat_sec),
    }


def streams(broker: Broker, cipher: Cipher) -> Record:
    """Each stream's length, groups, pending entries and lag (as `deferral streams`), and the
    newest dead letters: where they came from and why, never their token or payload, and
    whether each is verified (written by a deferral process)."""
    dead = [
        {
            "id": entry.id,
            **{
                name: entry.fields[name.encode()].decode(errors="replace")
                for name in DEAD_LETTER_FIELDS
                if name.encode() in entry.fields
            },
            "verified": deadletters.read_dead_letter(cipher, entry).verified,
        }
        for entry in broker.newest(broker.keys.dead, DEAD_LETTERS_SHOWN)
    ]
    return {
        "streams": stream_records(broker),
        "dead_letters": dead,
        "dead_letters_total": int(broker.redis.xlen(broker.keys.dead)),
    }


def doctor(settings: Settings) -> Record:
    checks = gather_checks(settings)
    return {
        "status": "fail" if checklist.exit_code(checks) else "ok",
        "checks": [{"status": c.status, "check": c.name, "detail": c.detail} for c in checks],
    }


def json_ready(value: Any) -> Any:
    """``value`` with mappings' keys as strings (counts keyed by state enums)."""
    if isinstance(value, Mapping):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value
