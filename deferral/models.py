"""SQLAlchemy models: the system of record. The Alembic migrations in ``migrations/`` build the
same schema; ``tests/integration/test_migrations.py`` fails on any drift between the two."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

Timestamp = DateTime(timezone=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def _id() -> Mapped[int]:
    return mapped_column(BigInteger, Identity(), primary_key=True)


def _created() -> Mapped[dt.datetime]:
    return mapped_column(Timestamp, server_default=func.now())


class DagRun(Base):
    __tablename__ = "dag_run"
    __table_args__ = (UniqueConstraint("dag_id", "run_id"), Index(None, "state"))

    id: Mapped[int] = _id()
    dag_id: Mapped[str] = mapped_column(String(250))
    run_id: Mapped[str] = mapped_column(String(250))
    logical_date: Mapped[dt.datetime] = mapped_column(Timestamp)
    state: Mapped[str] = mapped_column(String(20))
    conf: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[dt.datetime] = _created()
    start_date: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    end_date: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    updated_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.now(), onupdate=func.now()
    )


class Trigger(Base):
    __tablename__ = "trigger"

    id: Mapped[int] = _id()
    classpath: Mapped[str] = mapped_column(String(1000))
    kwargs: Mapped[str] = mapped_column(Text)  # Fernet token of the serialized kwargs
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    created_date: Mapped[dt.datetime] = _created()
    triggerer_id: Mapped[str | None] = mapped_column(String(250))


class TaskInstance(Base):
    __tablename__ = "task_instance"
    __table_args__ = (
        UniqueConstraint("dag_id", "run_id", "task_id", "map_index"),
        Index(None, "state", "queue", "priority_weight"),
        Index(
            "ix_task_instance_deferred_timeout",
            "trigger_timeout",
            postgresql_where=text("state = 'deferred'"),
        ),
    )

    id: Mapped[int] = _id()
    dag_id: Mapped[str] = mapped_column(String(250))
    run_id: Mapped[str] = mapped_column(String(250))
    task_id: Mapped[str] = mapped_column(String(250))
    map_index: Mapped[int] = mapped_column(Integer, server_default=text("-1"))
    state: Mapped[str] = mapped_column(String(20), server_default=text("'none'"))
    try_number: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    max_tries: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    pool: Mapped[str] = mapped_column(String(256), server_default=text("'default_pool'"))
    pool_slots: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    queue: Mapped[str] = mapped_column(String(256), server_default=text("'default'"))
    priority_weight: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    hostname: Mapped[str | None] = mapped_column(String(1000))
    worker: Mapped[str | None] = mapped_column(String(1000))
    start_date: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    end_date: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    queued_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    trigger_id: Mapped[int | None] = mapped_column(ForeignKey("trigger.id"), index=True)
    next_method: Mapped[str | None] = mapped_column(String(1000))
    next_kwargs: Mapped[str | None] = mapped_column(Text)  # Fernet token
    trigger_timeout: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    first_started_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    updated_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.now(), onupdate=func.now()
    )


class Triggerer(Base):
    __tablename__ = "triggerer"

    name: Mapped[str] = mapped_column(String(250), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(1000))
    pid: Mapped[int] = mapped_column(Integer)
    capacity: Mapped[int] = mapped_column(Integer)
    load: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    started_at: Mapped[dt.datetime] = _created()
    latest_heartbeat: Mapped[dt.datetime] = _created()
    state: Mapped[str] = mapped_column(String(20))


class ResumeEvent(Base):
    __tablename__ = "resume_event"

    dedup_key: Mapped[str] = mapped_column(String(250), primary_key=True)
    trigger_id: Mapped[int] = mapped_column(BigInteger, index=True)
    task_instance_id: Mapped[int | None] = mapped_column(BigInteger)
    outcome: Mapped[str] = mapped_column(String(20))
    received_at: Mapped[dt.datetime] = _created()


class Outbox(Base):
    __tablename__ = "outbox"
    __table_args__ = (
        Index("ix_outbox_unpublished", "created_at", postgresql_where=text("published_at IS NULL")),
    )

    id: Mapped[int] = _id()
    stream: Mapped[str] = mapped_column(String(250))
    fields: Mapped[dict[str, str]] = mapped_column(JSONB)
    created_at: Mapped[dt.datetime] = _created()
    published_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)


class TaskStateChange(Base):
    __tablename__ = "task_state_change"

    id: Mapped[int] = _id()
    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), index=True
    )
    from_state: Mapped[str] = mapped_column(String(20))
    to_state: Mapped[str] = mapped_column(String(20))
    at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.clock_timestamp())
    reason: Mapped[str | None] = mapped_column(Text)


class XCom(Base):
    __tablename__ = "xcom"

    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    value: Mapped[Any] = mapped_column(JSONB)
    created_at: Mapped[dt.datetime] = _created()


class Pool(Base):
    __tablename__ = "pool"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    slots: Mapped[int] = mapped_column(Integer)
    include_deferred: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    description: Mapped[str | None] = mapped_column(Text)


class TaskReschedule(Base):
    __tablename__ = "task_reschedule"

    id: Mapped[int] = _id()
    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), index=True
    )
    try_number: Mapped[int] = mapped_column(Integer)
    start_date: Mapped[dt.datetime] = mapped_column(Timestamp)
    end_date: Mapped[dt.datetime] = mapped_column(Timestamp)
    reschedule_date: Mapped[dt.datetime] = mapped_column(Timestamp)
