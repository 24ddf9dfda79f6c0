"""XCom storage in Postgres. Values are stored as tagged JSON (see serialization)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from deferral import serialization
from deferral.models import TaskInstance, XCom


def upsert(session: Session, task_instance_id: int, key: str, stored: Any) -> None:
    """Write a value already in serialization.to_jsonable form."""
    upsert_many(session, [(task_instance_id, key, stored)])


def upsert_many(session: Session, items: Sequence[tuple[int, str, Any]]) -> None:
    """Write (task instance id, key, value in to_jsonable form) items in one statement."""
    if not items:
        return
    statement = insert(XCom).values(
        [{"task_instance_id": ti_id, "key": key, "value": value} for ti_id, key, value in items]
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[XCom.task_instance_id, XCom.key],
            set_={"value": statement.excluded.value},
        )
    )


class DatabaseXComs:
    """The XCom backend of a running task: each call is its own short transaction."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        with self._sessions.begin() as session:
            upsert(
                session, task_instance_id, key, serialization.to_jsonable(value, f"XCom {key!r}")
            )

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        """The XCom of one map index, or (``map_index`` None) Airflow's default: the value of an
        unmapped task, or the list of the values a mapped task's map indexes pushed."""
        query = (
            select(TaskInstance.map_index, XCom.value)
            .join(TaskInstance, TaskInstance.id == XCom.task_instance_id)
            .where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
                XCom.key == key,
            )
            .order_by(TaskInstance.map_index)
        )
        if map_index is not None:
            query = query.where(TaskInstance.map_index == map_index)
        with self._sessions() as session:
            rows = session.execute(query).all()
        if not rows:
            return None
        values = [serialization.from_jsonable(stored) for _, stored in rows]
        return values[0] if map_index is not None or rows[0].map_index < 0 else values
