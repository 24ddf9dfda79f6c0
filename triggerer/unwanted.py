"""Which of the triggers held no task waits on any more (timed out, cleared, marked), and why:
asked after each heartbeat, in a thread, one set-based query whatever the number held, so that
only the few unwanted ones come back to the event loop."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from deferral.states import TaskState
from deferral.store.tables import TaskInstance, TaskStateChange
from triggerer import decide


def unwanted(
    sessions: sessionmaker[Session], trigger_ids: list[int], ti_ids: list[int]
) -> dict[int, str]:
    """Of the triggers held (for the task instances at the same positions), those no task
    waits on any more, with why (see decide.cancel_reason)."""
    with sessions() as session:
        wanted = set(
            session.scalars(
                text(
                    "SELECT held.trigger_id FROM unnest(CAST(:triggers AS bigint[]),"
                    " CAST(:tis AS bigint[])) AS held(trigger_id, ti_id)"
                    " JOIN task_instance ti ON ti.id = held.ti_id"
                    " WHERE ti.state = 'deferred' AND ti.trigger_id = held.trigger_id"
                ),
                # As array literals: psycopg dumps a list one element at a time in Python,
                # holding the GIL far longer than the join itself takes.
                {"triggers": _array(trigger_ids), "tis": _array(ti_ids)},
            )
        )
        gone = {t: i for t, i in zip(trigger_ids, ti_ids, strict=True) if t not in wanted}
        if gone:
            # A shared trigger is wanted while any task waits on it, not only the one it
            # was started for: asked of the few that look gone, not of every trigger held.
            waited = _waited_on(session, gone)
            gone = {t: i for t, i in gone.items() if t not in waited}
        if not gone:
            return {}
        left_deferred = (
            select(TaskStateChange.reason)
            .where(
                TaskStateChange.task_instance_id == TaskInstance.id,
                TaskStateChange.from_state == TaskState.DEFERRED,
            )
            .order_by(TaskStateChange.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        now = {
            row[0]: (row[1], row[2], row[3])
            for row in session.execute(
                select(
                    TaskInstance.id, TaskInstance.state, TaskInstance.trigger_id, left_deferred
                ).where(TaskInstance.id.in_(set(gone.values())))
            )
        }
    reasons = {}
    for trigger_id, ti_id in gone.items():
        state, ti_trigger_id, reason_text = now.get(ti_id, (None, None, None))
        reason = decide.cancel_reason(trigger_id, state, ti_trigger_id, reason_text)
        if reason is not None:
            reasons[trigger_id] = reason
    return reasons


def _waited_on(session: Session, trigger_ids: Collection[int]) -> set[int]:
    """Those of ``trigger_ids`` some deferred task still waits on."""
    return set(
        session.scalars(
            text(
                "SELECT DISTINCT trigger_id FROM task_instance WHERE state = 'deferred'"
                " AND trigger_id = ANY(CAST(:triggers AS bigint[]))"
            ),
            {"triggers": _array(list(trigger_ids))},
        )
    )


def _array(ids: list[int]) -> str:
    """A Postgres array literal of ``ids``, for ``CAST(:x AS bigint[])``."""
    return "{" + ",".join(map(str, ids)) + "}"
