"""Rows in the states tests start from, built through the real transitions, and the stream
entries that name them."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker.consumer import Delivery
from broker.replies import Entry
from broker.streams import TriggerMessage, trigger_message
from deferral.runtime import serialization
from deferral.runtime.crypto import Cipher, Purpose
from deferral.runtime.serialization import check_kwargs
from deferral.store import hitl, transitions
from deferral.store.tables import DagRun, TaskInstance
from deferral.store.transitions import Attempt, NewTaskInstance
from deferral.triggers import DateTimeTrigger
from deferral.triggers.base import classpath_of
from worker.outcomes import Outcome
from worker.service import Running, WorkerService

DAG_ID = "factory_dag"
WORKER = "worker-1"  # the worker the attempts of these rows run on


def running_task(
    sessions: sessionmaker[Session], task_id: str = "t", run_id: str = "r1", dag_id: str = DAG_ID
) -> int:
    """A DAG run with one task instance moved none -> scheduled -> queued -> running."""
    ti_id = queued_task(sessions, task_id, run_id, dag_id)
    with sessions.begin() as session:
        assert transitions.start_many(session, [(ti_id, 1)], "host", WORKER)
    return ti_id


def queued_task(
    sessions: sessionmaker[Session], task_id: str = "t", run_id: str = "r1", dag_id: str = DAG_ID
) -> int:
    """A DAG run with one task instance moved none -> scheduled -> queued."""
    with sessions.begin() as session:
        transitions.create_dag_run(session, dag_id, run_id, dt.datetime.now(dt.UTC), {})
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        ).one()
        transitions.start_dag_run(
            session, run, [NewTaskInstance(task_id, 0, "default_pool", 1, "default", 1)]
        )
        session.flush()
        ti_id = session.scalars(
            select(TaskInstance.id).where(
                TaskInstance.run_id == run_id, TaskInstance.task_id == task_id
            )
        ).one()
        transitions.schedule(session, [ti_id])
        transitions.dispatch(session, [ti_id])
    return ti_id


def awaiting_input_task(
    sessions: sessionmaker[Session],
    task_id: str = "t",
    run_id: str = "r1",
    defaults: tuple[str, ...] | None = None,
    params: dict[str, Any] | None = None,
) -> int:
    """A running task awaiting input (options yes / no, ``defaults``, ``params`` as stored:
    ``ParamsDict.dump()``); returns its id."""
    ti_id = running_task(sessions, task_id, run_id)
    with sessions.begin() as session:
        assert transitions.await_input(session, Attempt(ti_id, 1, WORKER))
        request = hitl.InputRequest("ok?", None, ("yes", "no"), defaults, False, params or {}, None)
        hitl.record_request(session, ti_id, 1, request)
    return ti_id


def deferred_task(
    sessions: sessionmaker[Session],
    cipher: Cipher,
    *,
    next_kwargs: dict[str, Any] | None = None,
    trigger_timeout: dt.datetime | None = None,
    task_id: str = "t",
    run_id: str = "r1",
) -> tuple[int, int]:
    """A running task deferred on a new trigger; returns (task instance id, trigger id)."""
    ti_id = running_task(sessions, task_id, run_id)
    return ti_id, defer_running(sessions, cipher, ti_id, next_kwargs, trigger_timeout)


def defer_running(
    sessions: sessionmaker[Session],
    cipher: Cipher,
    ti_id: int,
    next_kwargs: dict[str, Any] | None = None,
    trigger_timeout: dt.datetime | None = None,
) -> int:
    """Defer running task ``ti_id`` (try 1, on WORKER) on a new DateTimeTrigger, as the worker
    does; returns the trigger id."""
    with sessions.begin() as session:
        trigger_id = transitions.create_trigger(
            session,
            "deferral.triggers.temporal.DateTimeTrigger",
            cipher.seal(Purpose.TRIGGER_KWARGS, {"moment": dt.datetime.now(dt.UTC)}),
        )
        assert transitions.defer(
            session,
            Attempt(ti_id, 1, WORKER),
            trigger_id=trigger_id,
            next_method="resume",
            next_kwargs_token=cipher.seal(Purpose.RESUME_KWARGS, next_kwargs or {}),
            trigger_timeout=trigger_timeout,
        )
    return trigger_id


def finish_queued(
    sessions: sessionmaker[Session],
    *where: ColumnElement[bool],
    value: Any = None,
    ok: bool = True,
    skip: bool = False,
) -> None:
    """What a worker does with the queued attempt of the one task instance ``where`` selects:
    start it, then succeed (pushing ``value``), fail without a retry, or skip it."""
    with sessions.begin() as session:
        ti = session.scalars(select(TaskInstance).where(*where)).one()
        assert transitions.start_many(session, [(ti.id, ti.try_number)], "host", "w")
        attempt = Attempt(ti.id, ti.try_number, "w")
        if skip:
            assert transitions.skip(session, attempt, "skipped by the test")
        elif ok:
            stored = serialization.to_jsonable(value)
            assert transitions.succeed(session, attempt, stored)
        else:
            assert transitions.fail(session, attempt, "boom", allow_retry=False)


def timer_message(
    cipher: Cipher, trigger_id: int, moment: dt.datetime, task_instance_id: int, task: str
) -> TriggerMessage:
    """The triggers-stream entry of a ``DateTimeTrigger`` at ``moment``, deferred by try 1 of
    ``task_instance_id`` (named ``task``)."""
    return trigger_message(
        cipher,
        trigger_id=trigger_id,
        classpath=classpath_of(DateTimeTrigger),
        kwargs=check_kwargs({"moment": moment}),
        task_instance_id=task_instance_id,
        try_number=1,
        task=task,
    )


def deferred_timers(
    sessions: sessionmaker[Session], cipher: Cipher, count: int, moment: dt.datetime
) -> list[TriggerMessage]:
    """``count`` task instances of one running run (``timers``), each deferred in try 1 on a
    ``DateTimeTrigger`` at ``moment``, written set-based (a thousand take a moment), and their
    triggers-stream entries."""
    with sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date)"
                " VALUES (:dag, 'timers', now(), 'running', now())"
            ),
            {"dag": DAG_ID},
        )
        trigger_ids = list(
            session.scalars(
                text(
                    "INSERT INTO trigger (classpath, kwargs)"
                    " SELECT :classpath, '' FROM generate_series(1, :n) RETURNING id"
                ),
                {"classpath": classpath_of(DateTimeTrigger), "n": count},
            )
        )
        ti_ids = list(
            session.scalars(
                text(
                    "INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number,"
                    " trigger_id, next_method, start_date, first_started_at)"
                    " SELECT :dag, 'timers', 't' || t.ord, 'deferred', 1, t.id, 'resume',"
                    " now(), now()"
                    " FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY AS t(id, ord)"
                    " ORDER BY t.ord RETURNING id"
                ),
                {"dag": DAG_ID, "ids": trigger_ids},
            )
        )
    return [
        timer_message(cipher, trigger_id, moment, ti_id, f"{DAG_ID}.timers.t{n}")
        for n, (trigger_id, ti_id) in enumerate(zip(trigger_ids, ti_ids, strict=True), 1)
    ]


def worker_batch(
    worker: WorkerService, outcomes: Sequence[tuple[int, Outcome]]
) -> list[tuple[Running, Outcome]]:
    """Outcomes of attempts on ``worker`` (task instance id, outcome), each as delivered from
    its queue stream (a deferral's trigger goes to that queue's triggers stream), as the
    worker records a batch of them."""
    return [
        (
            Running(
                Delivery(Entry(worker.streams[0], f"0-{i + 1}", {}), 1),
                transitions.Attempt(ti, 1, WORKER),
                f"{DAG_ID}.r{i}.t",
            ),
            outcome,
        )
        for i, (ti, outcome) in enumerate(outcomes)
    ]
