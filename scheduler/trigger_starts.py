"""Tasks that start in the triggerer (``start_from_trigger``): as the scheduler schedules them, it
defers them to their ``start_trigger_args`` trigger in the same transaction, so no worker slot
(nor pool slot) is taken for ``execute``; the trigger's entry is staged in the outbox."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker import outbox
from broker.streams import StreamKeys, task_label, trigger_message
from deferral.dag import DAG
from deferral.runtime import serialization
from deferral.runtime.crypto import Cipher, Purpose
from deferral.store.tables import TaskInstance
from deferral.store.transitions.from_trigger import TriggerStart, start_from_trigger
from deferral.triggers.task_end import start_trigger

log = logging.getLogger("deferral.scheduler")


def starters(dag: DAG) -> frozenset[str]:
    """The tasks of ``dag`` that start in the triggerer."""
    return frozenset(
        task_id
        for task_id, task in dag.task_dict.items()
        if getattr(task, "start_from_trigger", False)
        and getattr(task, "start_trigger_args", None) is not None
    )


def start_in_triggerer(
    session: Session, dag: DAG, scheduled: Sequence[int], cipher: Cipher, keys: StreamKeys
) -> tuple[set[int], list[outbox.Staged]]:
    """Defer those of the ``scheduled`` task instances of ``dag`` whose task starts in the
    triggerer; returns their ids and the outbox rows of their trigger entries. A task whose
    start_trigger_args cannot make a trigger is left scheduled: a worker then runs it, and the
    same error fails it there, in its log."""
    tasks = starters(dag)
    if not tasks or not scheduled:
        return set(), []
    rows = session.execute(
        select(
            TaskInstance.id,
            TaskInstance.run_id,
            TaskInstance.task_id,
            TaskInstance.map_index,
            TaskInstance.queue,
        )
        .where(TaskInstance.id.in_(scheduled), TaskInstance.task_id.in_(tasks))
        .order_by(TaskInstance.id)
    ).all()
    starts, specs = [], {}
    now = dt.datetime.now(dt.UTC)
    for row in rows:
        args = dag.task_dict[row.task_id].start_trigger_args
        if args is None:  # (starters() left such tasks out)
            continue
        try:
            classpath, kwargs = start_trigger(args).serialize()
            kwargs = serialization.check_kwargs(kwargs, "trigger kwargs")
            next_kwargs = serialization.check_kwargs(args.next_kwargs or {}, "next_kwargs")
        except Exception as exc:
            log.warning(
                "task %s of DAG %s cannot start in the triggerer (a worker runs it): %s: %s",
                row.task_id,
                dag.dag_id,
                type(exc).__name__,
                exc,
            )
            continue
        starts.append(
            TriggerStart(
                row.id,
                classpath,
                cipher.encrypt(Purpose.TRIGGER_KWARGS, serialization.encode(kwargs)),
                args.next_method,
                cipher.encrypt(Purpose.RESUME_KWARGS, serialization.encode(next_kwargs)),
                None if args.timeout is None else now + args.timeout,
            )
        )
        specs[row.id] = (row, classpath, kwargs)
    moved = start_from_trigger(session, starts)
    tries = {
        row.id: row.try_number
        for row in session.execute(
            select(TaskInstance.id, TaskInstance.try_number).where(TaskInstance.id.in_(moved))
        )
    }
    messages = []
    for ti_id, trigger_id in moved.items():
        row, classpath, kwargs = specs[ti_id]
        message = trigger_message(
            cipher,
            trigger_id=trigger_id,
            classpath=classpath,
            kwargs=kwargs,
            task_instance_id=ti_id,
            try_number=tries[ti_id],
            task=task_label(dag.dag_id, row.run_id, row.task_id, row.map_index),
        )
        # A trigger goes to its task's queue, as a deferring task's does (and as the
        # reconciler looks for it).
        messages.append((keys.trigger_stream(row.queue, trigger_id), message))
    return set(moved), outbox.stage_many(session, messages)
