"""Task instances as the web UI and the CLI show them: one in detail (why it is in its state,
its history, what it waits on, its rendered fields, XComs and log), pages of them, and the
lines of a try's log. Never a secret: resume kwargs are not read; values users wrote are
passed through the secrets masker."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.secrets_masker import redact
from deferral.states import FINISHED_STATES, TaskState
from deferral.store import liveness, tasklogs
from deferral.store.actions import ti_label
from deferral.store.serialized_dags import read_dag
from deferral.store.stored_secrets import known_secrets, shown_xcom
from deferral.store.tables import (
    RenderedTaskInstanceFields,
    TaskInstance,
    TaskStateChange,
    Trigger,
    Triggerer,
    XCom,
)
from deferral.triggers.composite import COMPOSITES
from readmodel.dags import operator_name
from readmodel.errors import NotFound
from readmodel.explain import explain
from readmodel.pages import Page, decode, page_of
from readmodel.progress import progress_of
from readmodel.records import db_now, find_run, run_record, seconds_between, task_instances
from readmodel.waits import (
    RUNNING_COMPOSITE,
    how_to_resume,
    is_held,
    needs_key,
    row_wait_of,
    signal_key,
    wait_record,
)

Record = dict[str, Any]

# A page shows at most this many lines of a try's log (the API pages through all of them).
LOG_LINES_SHOWN = 5000

# What a listing shows of a task instance (never its resume kwargs or event).
_LISTED = (
    TaskInstance.id,
    TaskInstance.dag_id,
    TaskInstance.run_id,
    TaskInstance.task_id,
    TaskInstance.map_index,
    TaskInstance.state,
    TaskInstance.try_number,
    TaskInstance.trigger_id,
    TaskInstance.trigger_timeout,
)

# A try has ended once its task instance is finished or waits for its next try.
_TRY_ENDED = frozenset({*FINISHED_STATES, TaskState.UP_FOR_RETRY})


def task_list(
    session: Session,
    *,
    limit: int,
    after: str | None = None,
    state: str | None = None,
    dag_id: str | None = None,
) -> Page:
    """A page of task instances, newest first (by id: an index gives that order, also within a
    state or a DAG), from just after cursor ``after``; deferred ones with their trigger and its
    timeout."""
    query = select(*_LISTED).order_by(TaskInstance.id.desc()).limit(limit + 1)
    if after is not None:
        (last_id,) = decode(after, int)
        query = query.where(TaskInstance.id < last_id)
    if state is not None:
        query = query.where(TaskInstance.state == state)
    if dag_id is not None:
        query = query.where(TaskInstance.dag_id == dag_id)
    return page_of(session.execute(query).all(), limit, task_record, lambda row: (row.id,))


def task_record(ti: Any) -> Record:
    """A listing's row of one task instance (a TaskInstance or a row of its listed columns)."""
    deferred = ti.state == TaskState.DEFERRED
    return {
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "map_index": ti.map_index,
        "state": ti.state,
        "try_number": ti.try_number,
        "trigger_id": ti.trigger_id if deferred else None,
        "trigger_timeout": ti.trigger_timeout if deferred else None,
    }


def task_instance_detail(
    session: Session,
    settings: Settings,
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
    dag = read_dag(session, dag_id)
    if not tis and (dag is None or task_id not in dag.task_dict):
        raise NotFound(f"run {run_id!r} of DAG {dag_id!r} has no task {task_id!r}")
    base = {
        "dag_id": dag_id,
        "run_id": run_id,
        "task_id": task_id,
        "run": {**run_record(run), "conf": redact(dict(run.conf or {}))},
        "operator": operator_name(dag, task_id),
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
    now = db_now(session)
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
            "duration_sec": seconds_between(ti.start_date, ti.end_date or now)
            if ti.start_date
            else None,
        },
        "explain": [line.strip() for line in explain(session, settings, dag, run, ti)[1:]],
        "history": _history(session, ti.id, now),
        "deferred": _deferral(session, settings, ti, now),
        "progress": progress_of(session, Cipher(settings.fernet_keys), ti),
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


def state_changes(session: Session, ti_id: int) -> list[TaskStateChange]:
    """Every recorded state change of a task instance, in order."""
    return list(
        session.scalars(
            select(TaskStateChange)
            .where(TaskStateChange.task_instance_id == ti_id)
            .order_by(TaskStateChange.id)
        )
    )


def _history(session: Session, ti_id: int, now: dt.datetime) -> list[Record]:
    """Each recorded state change and how long the state it entered lasted (the latest, if
    unfinished: until now)."""
    changes = state_changes(session, ti_id)
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
                "lasted_sec": None if open_ended else seconds_between(change.at, ended or now),
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
    classpath = trigger.classpath if trigger is not None else None
    held = trigger is None or classpath not in COMPOSITES or is_held(session, trigger.id)
    row_wait = row_wait_of(classpath, held)
    return {
        "trigger_id": ti.trigger_id,
        "classpath": classpath,
        "row_wait": row_wait,
        "running_branch": None if held else RUNNING_COMPOSITE,
        "resumed_by": (
            None
            if row_wait is None
            else how_to_resume(
                row_wait, signal_key(session, ti.trigger_id) if needs_key(row_wait) else None
            )
        ),
        "triggerer": trigger.triggerer_id if trigger is not None else None,
        "triggerer_alive": triggerer is not None
        and liveness.is_alive(
            triggerer.state, triggerer.latest_heartbeat, now, settings.heartbeat_sec
        ),
        "next_method": ti.next_method,
        **wait_record(since, ti.trigger_timeout, now),
    }


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
