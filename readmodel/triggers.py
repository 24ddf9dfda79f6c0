"""Triggers as ``deferral triggers list`` gives them: class, the triggerer running it and the
tasks waiting on it, a page at a time. Never their kwargs (ciphertext that stays in the
database)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.streams import task_label
from deferral.store.tables import TaskInstance, Trigger
from readmodel.pages import Page, decode, page_of


def trigger_list(session: Session, *, limit: int, after: str | None = None) -> Page:
    """A page of triggers, oldest first, from just after cursor ``after``, each with the labels
    of the task instances waiting on it."""
    query = (
        select(Trigger.id, Trigger.classpath, Trigger.triggerer_id, Trigger.created_date)
        .order_by(Trigger.id)
        .limit(limit + 1)
    )
    if after is not None:
        (last_id,) = decode(after, int)
        query = query.where(Trigger.id > last_id)
    found = session.execute(query).all()
    waiting = _waiting_tasks(session, [row.id for row in found[:limit]])
    return page_of(
        found,
        limit,
        lambda row: {
            "id": row.id,
            "classpath": row.classpath,
            "triggerer_id": row.triggerer_id,
            "created_date": row.created_date,
            "waiting_tasks": waiting.get(row.id, []),
        },
        lambda row: (row.id,),
    )


def _waiting_tasks(session: Session, trigger_ids: Sequence[int]) -> dict[int | None, list[str]]:
    """Trigger id -> labels (dag.run.task[map]) of the task instances waiting on it."""
    if not trigger_ids:
        return {}
    query = (
        select(
            TaskInstance.trigger_id,
            TaskInstance.dag_id,
            TaskInstance.run_id,
            TaskInstance.task_id,
            TaskInstance.map_index,
        )
        .where(TaskInstance.trigger_id.in_(trigger_ids))
        .order_by(TaskInstance.id)
    )
    waiting: dict[int | None, list[str]] = {}
    for trigger_id, dag_id, run_id, task_id, map_index in session.execute(query):
        waiting.setdefault(trigger_id, []).append(task_label(dag_id, run_id, task_id, map_index))
    return waiting
