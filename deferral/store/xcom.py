"""XCom storage in Postgres. Values are stored as tagged JSON (see serialization)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from deferral.models.xcom import BaseXCom, StoredXCom
from deferral.runtime import serialization
from deferral.store.tables import TaskInstance, XCom


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


# The key of a task's return value.
RETURN_VALUE = "return_value"


def stored_value(
    backend: type[BaseXCom],
    value: Any,
    *,
    key: str,
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int,
    what: str | None = None,
) -> Any:
    """What is stored for an XCom: what the backend's ``serialize_value`` makes of ``value``, in
    to_jsonable form (SerializationError, naming ``what`` or the key, if it cannot be)."""
    serialized = backend.serialize_value(
        value, key=key, task_id=task_id, dag_id=dag_id, run_id=run_id, map_index=map_index
    )
    return serialization.to_jsonable(serialized, what or f"XCom {key!r}")


class DatabaseXComs:
    """The XCom backend of a running task: each call is its own short transaction; values go
    through ``backend`` (``DEFERRAL_XCOM_BACKEND``) on their way in and out."""

    def __init__(self, sessions: sessionmaker[Session], backend: type[BaseXCom] = BaseXCom) -> None:
        self._sessions = sessions
        self.backend = backend

    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        with self._sessions.begin() as session:
            ti = session.get(TaskInstance, task_instance_id)
            if ti is None:
                raise LookupError(f"no task instance {task_instance_id} to push XCom {key!r} for")
            stored = stored_value(
                self.backend,
                value,
                key=key,
                dag_id=ti.dag_id,
                run_id=ti.run_id,
                task_id=ti.task_id,
                map_index=ti.map_index,
            )
            upsert(session, task_instance_id, key, stored)

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
        values = [
            self.backend.deserialize_value(
                StoredXCom(key, serialization.from_jsonable(stored), dag_id, run_id, task_id, index)
            )
            for index, stored in rows
        ]
        return values[0] if map_index is not None or rows[0].map_index < 0 else values
