"""XCom storage in Postgres. Values are stored as tagged JSON (see serialization)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from deferral import serialization
from deferral.models import TaskInstance, XCom


def upsert(session: Session, task_instance_id: int, key: str, stored: Any) -> None:
    """Write a value already in serialization.to_jsonable form."""
    statement = insert(XCom).values(task_instance_id=task_instance_id, key=key, value=stored)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[XCom.task_instance_id, XCom.key], set_={"value": stored}
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

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int) -> Any:
        query = (
            select(XCom.value)
            .join(TaskInstance, TaskInstance.id == XCom.task_instance_id)
            .where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
                TaskInstance.map_index == map_index,
                XCom.key == key,
            )
        )
        with self._sessions() as session:
            stored = session.scalar(query)
        return None if stored is None else serialization.from_jsonable(stored)
