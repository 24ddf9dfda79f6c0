"""SQLAlchemy models: the system of record. The Alembic migrations in ``migrations/`` build the
same schema; ``tests/integration/test_migrations.py`` fails on any drift between the two."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSON, JSONB
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


def _partitioned_id(table: str) -> Mapped[int]:
    """The id of a partitioned table (deferral.store.partitions), from a sequence: PostgreSQL before
    17 has no identity column on a partitioned table. Its primary key adds the partition key."""
    return mapped_column(
        BigInteger, server_default=text(f"nextval('{table}_id_seq'::regclass)"), primary_key=True
    )


def _created() -> Mapped[dt.datetime]:
    return mapped_column(Timestamp, server_default=func.now())


class Dag(Base):
    """What the schedulers last parsed of each DAG, and what users set on it (paused)."""

    __tablename__ = "dag"
    __table_args__ = (
        # The scheduler's "is any run due?" query reads only this index when none is.
        Index(
            "ix_dag_next_dagrun_create_after",
            "next_dagrun_create_after",
            postgresql_where=text("next_dagrun_create_after IS NOT NULL"),
        ),
    )

    dag_id: Mapped[str] = mapped_column(String(250), primary_key=True)
    fileloc: Mapped[str | None] = mapped_column(Text)
    is_paused: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # False once no DAG file defines it any more.
    is_active: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    schedule: Mapped[str | None] = mapped_column(Text)
    max_active_tasks: Mapped[int] = mapped_column(Integer, server_default=text("16"))
    max_active_runs: Mapped[int] = mapped_column(Integer, server_default=text("16"))
    next_dagrun: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    next_dagrun_data_interval_start: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    next_dagrun_data_interval_end: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    next_dagrun_create_after: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    # Since when the DAG cannot be loaded (its file fails to import, or no longer defines it);
    # its running runs are failed once DEFERRAL_DAG_IMPORT_GRACE_SEC has passed.
    missing_since: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    missing_reason: Mapped[str | None] = mapped_column(Text)
    last_parsed_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    # The DAG's tags as last parsed: the web UI lists and filters by them.
    tags: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'::text[]"))


class DagImportError(Base):
    """A DAG file that fails to import, as the schedulers last saw it."""

    __tablename__ = "import_error"

    filename: Mapped[str] = mapped_column(String(1000), primary_key=True)
    error: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[dt.datetime] = _created()
    last_seen: Mapped[dt.datetime] = _created()


class SerializedDag(Base):
    """A DAG as the last parse found it (``deferral.store.serialized_dags``): what the web UI
    and the CLI show of it, so that they never import a DAG file."""

    __tablename__ = "serialized_dag"

    dag_id: Mapped[str] = mapped_column(String(250), primary_key=True)
    fileloc: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # The document's sha256: a parse that finds the DAG unchanged does not rewrite its row.
    dag_hash: Mapped[str] = mapped_column(String(64))
    updated_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())


class DagFolderParse(Base):
    """When a scheduler last recorded a parse of its DAGs folder: none yet means nothing has
    been parsed, which the web UI and the CLI say rather than import the folder themselves."""

    __tablename__ = "dag_folder_parse"

    folder: Mapped[str] = mapped_column(Text, primary_key=True)
    parsed_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())


class DagRun(Base):
    __tablename__ = "dag_run"
    __table_args__ = (
        UniqueConstraint("dag_id", "run_id"),
        # One run per logical date, as Airflow 2 enforces: what makes scheduler replicas create
        # each scheduled run exactly once (INSERT ... ON CONFLICT DO NOTHING).
        UniqueConstraint("dag_id", "logical_date"),
        Index(None, "state"),
        Index(None, "dag_id", "state"),
        # Runs listed newest logical date first, a page at a time (readmodel.runs).
        Index("ix_dag_run_logical_date_id", "logical_date", "id"),
        Index(
            "ix_dag_run_evaluate_after",
            "evaluate_after",
            postgresql_where=text("evaluate_after IS NOT NULL"),
        ),
        # The start pass walks each DAG's queued runs oldest first, and finds the DAGs that
        # have any by a skip scan of this index: never a read of every queued run.
        Index(
            "ix_dag_run_queued",
            "dag_id",
            "logical_date",
            "id",
            postgresql_where=text("state = 'queued'"),
        ),
        # A DAG's latest scheduled or backfill run, however many manual runs came after it.
        Index(
            "ix_dag_run_automated",
            "dag_id",
            "logical_date",
            postgresql_where=text("run_type IN ('backfill', 'scheduled')"),
        ),
    )

    id: Mapped[int] = _id()
    dag_id: Mapped[str] = mapped_column(String(250))
    run_id: Mapped[str] = mapped_column(String(250))
    run_type: Mapped[str] = mapped_column(String(20), server_default=text("'manual'"))
    logical_date: Mapped[dt.datetime] = mapped_column(Timestamp)
    data_interval_start: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    data_interval_end: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    state: Mapped[str] = mapped_column(String(20))
    conf: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    # The partition key of a run a PartitionedAssetTimetable made.
    partition_key: Mapped[str | None] = mapped_column(String(250))
    created_at: Mapped[dt.datetime] = _created()
    start_date: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    end_date: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    updated_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.now(), onupdate=func.now()
    )
    # Set when something changed that may let the run move on (a task finished, the run was
    # created or reopened); the scheduler evaluates only these runs, so idle runs cost nothing.
    evaluate_after: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    # Why the last evaluation of this run raised (cleared by the next one that succeeds).
    scheduling_error: Mapped[str | None] = mapped_column(Text)


class DagRunCount(Base):
    """How many runs of a DAG are queued and running, kept as they change: a row per change
    (+1 or -1 by state), written by PostgreSQL triggers on ``dag_run`` (migration 0021), summed
    and folded into one row per (DAG, state) by whoever holds the DAG's row lock
    (``scheduler.dagruns``). max_active_runs is decided from these sums, never by counting the
    runs (scheduler/DECISIONS.md 27)."""

    __tablename__ = "dag_run_count"

    id: Mapped[int] = _id()
    dag_id: Mapped[str] = mapped_column(String(250), index=True)
    state: Mapped[str] = mapped_column(String(20))
    delta: Mapped[int] = mapped_column(Integer)


class Trigger(Base):
    __tablename__ = "trigger"
    __table_args__ = (
        # The horizon pass reads the earliest unpublished far timers (deferral.store.far_timers).
        Index(
            "ix_trigger_far_moment", "far_moment", postgresql_where=text("far_moment IS NOT NULL")
        ),
        # The sweep for shared triggers nobody waits on pages through these by id.
        Index("ix_trigger_shared_id", "id", postgresql_where=text("share_key IS NOT NULL")),
    )

    id: Mapped[int] = _id()
    classpath: Mapped[str] = mapped_column(String(1000))
    kwargs: Mapped[str] = mapped_column(Text)  # Fernet token of the serialized kwargs
    created_date: Mapped[dt.datetime] = _created()
    triggerer_id: Mapped[str | None] = mapped_column(String(250))
    # Set on a shared trigger only: a keyed digest of its classpath and kwargs (never the kwargs
    # themselves), unique, so that equal deferrals wait on this one row (transitions.shared).
    share_key: Mapped[str | None] = mapped_column(String(64), unique=True, index=True)
    # Set only while a far time trigger waits as a row, its entry not yet published: its moment
    # (deferral.store.far_timers). NULL for every trigger whose entry has been published.
    far_moment: Mapped[dt.datetime | None] = mapped_column(Timestamp)


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
        Index(
            "ix_task_instance_due",
            "due_at",
            postgresql_where=text("state IN ('up_for_retry', 'up_for_reschedule')"),
        ),
        Index("ix_task_instance_state_id", "state", "id"),
        # The read model's pages (readmodel.tasks, readmodel.waits): a DAG's task instances
        # newest first; deferred ones by the trigger they wait on (created when they deferred).
        Index("ix_task_instance_dag_id_id", "dag_id", "id"),
        Index(
            "ix_task_instance_deferred_order",
            "trigger_id",
            "id",
            postgresql_where=text("state = 'deferred'"),
        ),
        # Dispatch order (decide.dispatch_key): read in order, stopped at the pools' room.
        Index(
            "ix_task_instance_scheduled",
            text("priority_weight DESC"),
            text("(next_method IS NOT NULL) DESC"),
            "id",
            postgresql_where=text("state = 'scheduled'"),
        ),
        # A run's evaluation probes its unfinished task instances by state (waiting, retries
        # without a due time, any at all) instead of counting all of its task instances.
        Index(
            "ix_task_instance_run_unfinished",
            "dag_id",
            "run_id",
            "state",
            "task_id",
            postgresql_where=text(
                "state NOT IN ('success', 'failed', 'skipped', 'upstream_failed', 'removed')"
            ),
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
    # Fernet token of the event payload a trigger resumed the task with, as the triggerer sealed
    # it: carried beside next_kwargs (the worker adds it as ``event``), not merged into them.
    next_event: Mapped[str | None] = mapped_column(Text)
    trigger_timeout: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    first_started_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    # When an up_for_retry task may run its next try, or an up_for_reschedule one poke again.
    due_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    updated_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.now(), onupdate=func.now()
    )


class Worker(Base):
    """A worker process, for liveness (heartbeat) and the CLI."""

    __tablename__ = "worker"

    name: Mapped[str] = mapped_column(String(250), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(1000))
    pid: Mapped[int] = mapped_column(Integer)
    queue: Mapped[str] = mapped_column(String(256))
    concurrency: Mapped[int] = mapped_column(Integer)
    load: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    started_at: Mapped[dt.datetime] = _created()
    latest_heartbeat: Mapped[dt.datetime] = _created()
    state: Mapped[str] = mapped_column(String(20))


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
    # The task queues it serves, comma-separated (deferral.store.queues); NULL: every queue.
    queues: Mapped[str | None] = mapped_column(String(256), nullable=True)


class Scheduler(Base):
    """A scheduler process, for liveness (heartbeat): ``deferral health`` and the CLI."""

    __tablename__ = "scheduler"

    name: Mapped[str] = mapped_column(String(250), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(1000))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[dt.datetime] = _created()
    latest_heartbeat: Mapped[dt.datetime] = _created()
    state: Mapped[str] = mapped_column(String(20))


class ResumeEvent(Base):
    __tablename__ = "resume_event"
    # Partitioned by day (deferral.store.partitions): the key includes the partition key.
    __table_args__ = ({"postgresql_partition_by": "RANGE (received_at)"},)

    dedup_key: Mapped[str] = mapped_column(String(250), primary_key=True)
    trigger_id: Mapped[int] = mapped_column(BigInteger, index=True)
    task_instance_id: Mapped[int | None] = mapped_column(BigInteger)
    outcome: Mapped[str] = mapped_column(String(20))
    received_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.now(), index=True, primary_key=True
    )


class Outbox(Base):
    __tablename__ = "outbox"
    __table_args__ = (
        Index("ix_outbox_unpublished", "created_at", postgresql_where=text("published_at IS NULL")),
        Index(
            "ix_outbox_published", "published_at", postgresql_where=text("published_at IS NOT NULL")
        ),
    )

    id: Mapped[int] = _id()
    stream: Mapped[str] = mapped_column(String(250))
    fields: Mapped[dict[str, str]] = mapped_column(JSONB)
    # The fields of the row's further entries for the same stream, published after ``fields``
    # in this order; NULL for a row of one entry.
    more_fields: Mapped[list[dict[str, str]] | None] = mapped_column(JSONB)
    created_at: Mapped[dt.datetime] = _created()
    published_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)


class TaskStateChange(Base):
    __tablename__ = "task_state_change"
    __table_args__ = ({"postgresql_partition_by": "RANGE (at)"},)

    id: Mapped[int] = _partitioned_id("task_state_change")
    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), index=True
    )
    from_state: Mapped[str] = mapped_column(String(20))
    to_state: Mapped[str] = mapped_column(String(20))
    at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.clock_timestamp(), primary_key=True
    )
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


class StoredVariable(Base):
    """A Variable (``deferral.variables.Variable`` is the API). ``val`` is a Fernet token when
    ``is_encrypted``; rows written by deferral always are."""

    __tablename__ = "variable"

    id: Mapped[int] = _id()
    key: Mapped[str] = mapped_column(String(250), unique=True)
    val: Mapped[str | None] = mapped_column(Text)
    description: Mapped[str | None] = mapped_column(Text)
    is_encrypted: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


class StoredConnection(Base):
    """A Connection (``deferral.connections.Connection`` is the API). ``password`` and ``extra``
    are always Fernet tokens."""

    __tablename__ = "connection"

    id: Mapped[int] = _id()
    conn_id: Mapped[str] = mapped_column(String(250), unique=True)
    conn_type: Mapped[str] = mapped_column(String(500))
    description: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(String(500))
    schema: Mapped[str | None] = mapped_column(String(500))
    login: Mapped[str | None] = mapped_column(Text)
    password: Mapped[str | None] = mapped_column(Text)
    port: Mapped[int | None] = mapped_column(Integer)
    extra: Mapped[str | None] = mapped_column(Text)


class RenderedTaskInstanceFields(Base):
    """What each template field of a task rendered to, per try (secrets masked), for
    ``deferral tasks render``. A resumed or rescheduled try renders again and overwrites its row."""

    __tablename__ = "rendered_task_instance_fields"

    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), primary_key=True
    )
    try_number: Mapped[int] = mapped_column(Integer, primary_key=True)
    # json, not jsonb: the fields (and keys within them) keep the order the task declared.
    rendered: Mapped[dict[str, Any]] = mapped_column(JSON)
    rendered_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.now(), onupdate=func.now()
    )


class TaskLog(Base):
    """A line of a try's log (``deferral.store.tasklogs``): what the attempt wrote, what the worker
    and
    the triggerer wrote about it, and the marker where the try's log was cut."""

    __tablename__ = "task_log"
    __table_args__ = (
        Index(None, "task_instance_id", "try_number", "id"),
        {"postgresql_partition_by": "RANGE (at)"},
    )

    id: Mapped[int] = _partitioned_id("task_log")
    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE")
    )
    try_number: Mapped[int] = mapped_column(Integer)
    # When the writer saw the line (its own clock); lines are shown in id order. The partition
    # key (deferral.store.partitions).
    at: Mapped[dt.datetime] = mapped_column(Timestamp, primary_key=True)
    source: Mapped[str] = mapped_column(String(20))
    text: Mapped[str] = mapped_column(Text)


class TaskLogTry(Base):
    """One row per try that has log lines: how many bytes its bounded lines hold and whether it
    was cut. Writers lock it before adding lines, so a try's lines are numbered in commit
    order."""

    __tablename__ = "task_log_try"

    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), primary_key=True
    )
    try_number: Mapped[int] = mapped_column(Integer, primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    cut: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


class User(Base):
    """Who may log in to the web UI: a name and an argon2 hash of the password
    (``webserver.users``); never the password itself."""

    __tablename__ = "user"

    id: Mapped[int] = _id()
    username: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _created()


class ApiToken(Base):
    """A machine's API token (``webserver.tokens``): its name, what it may do, and a keyed hash
    of its secret (``Purpose.API_TOKEN``); never the secret itself. Revoking deletes the row."""

    __tablename__ = "api_token"

    id: Mapped[int] = _id()
    name: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text))
    digest: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _created()


class HITLDetail(Base):
    """What a task awaiting input (``HITLOperator``) asks, and the response once given: one row
    per task instance, rewritten by each try that asks. ``deferral.store.hitl`` reads and writes
    it."""

    __tablename__ = "hitl_detail"
    __table_args__ = (
        Index(
            "ix_hitl_detail_open_timeout",
            "timeout_at",
            postgresql_where=text("responded_at IS NULL AND timeout_at IS NOT NULL"),
        ),
    )

    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), primary_key=True
    )
    try_number: Mapped[int] = mapped_column(Integer)
    subject: Mapped[str] = mapped_column(Text)
    body: Mapped[str | None] = mapped_column(Text)
    options: Mapped[list[str]] = mapped_column(JSONB)
    defaults: Mapped[list[str] | None] = mapped_column(JSONB)
    multiple: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    params: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[dt.datetime] = _created()
    # When a response stops being awaited (the task's execution_timeout); None: never.
    timeout_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    responded_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    # The logged-in user who responded; None with responded_at set: the timeout chose.
    responded_by: Mapped[str | None] = mapped_column(String(64))
    chosen_options: Mapped[list[str] | None] = mapped_column(JSONB)
    params_input: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


class DeadlineMiss(Base):
    """A DAG run that had not finished by its ``DeadlineAlert``'s deadline: one row per run and
    alert, inserted once (the scheduler replica whose insert wins runs the callback)."""

    __tablename__ = "deadline_miss"
    __table_args__ = (UniqueConstraint("dag_run_id", "alert_index"),)

    id: Mapped[int] = _id()
    dag_run_id: Mapped[int] = mapped_column(ForeignKey("dag_run.id", ondelete="CASCADE"))
    dag_id: Mapped[str] = mapped_column(String(250), index=True)
    run_id: Mapped[str] = mapped_column(String(250))
    alert_index: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    deadline: Mapped[dt.datetime] = mapped_column(Timestamp)
    missed_at: Mapped[dt.datetime] = _created()
    # What became of the callback: pending, done, or failed: <one line>.
    callback_state: Mapped[str] = mapped_column(Text, server_default=text("'pending'"))


class WebSession(Base):
    """A login to the web UI, server-side: the cookie holds a random token whose SHA-256 is the
    row's id, so logging out (deleting the row) ends every copy of the cookie, and a row past
    ``expires_at`` (set at login, never extended) is no login."""

    __tablename__ = "web_session"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    username: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[dt.datetime] = _created()
    expires_at: Mapped[dt.datetime] = mapped_column(Timestamp, index=True)


class IdempotencyKey(Base):
    """A request made once under an idempotency key (``deferral.store.idempotency``): a
    repeat within the window returns ``answer``, the first request's, and acts no more. The
    primary key is what makes concurrent repeats wait for the first and then read its answer."""

    __tablename__ = "idempotency_key"

    # What the key is unique within: the kind of request and who makes it.
    scope: Mapped[str] = mapped_column(Text, primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # A MAC of the request (Purpose.IDEMPOTENT_REQUEST): a repeat with another request differs.
    fingerprint: Mapped[str] = mapped_column(Text)
    answer: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    created_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.now(), index=True
    )


class Signal(Base):
    """A signal sent to a key (``deferral.signals``), kept for a bounded age so that a wait
    with a lookback can match one sent before it."""

    __tablename__ = "signal"
    __table_args__ = (
        Index("ix_signal_key_sent_at", "key", "sent_at"),
        Index(
            "ix_signal_sent_by_id", "sent_by", "id", postgresql_where=text("sent_by IS NOT NULL")
        ),
    )

    id: Mapped[int] = _id()
    key: Mapped[str] = mapped_column(Text)
    payload: Mapped[str] = mapped_column(Text)  # Fernet token of the payload's JSON
    sent_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.clock_timestamp(), index=True
    )
    # The web user whose send stored it (NULL: the library or the CLI), for the per-user quota.
    sent_by: Mapped[str | None] = mapped_column(String(64))


class SignalCount(Base):
    """How many signals a sender (``signal.sent_by``) has stored: the sum of its stripes. A
    send adds to the stripe of its connection (concurrent sends rarely share a row lock) what
    it inserted less what it deleted, so the quota's excess is found without counting rows."""

    __tablename__ = "signal_count"

    sent_by: Mapped[str] = mapped_column(String(64), primary_key=True)
    stripe: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    stored: Mapped[int] = mapped_column(BigInteger)


class SignalWait(Base):
    """A task deferred on a signal (or callback) key: a row, not a trigger run in a triggerer;
    a send resumes it. Goes with its trigger row."""

    __tablename__ = "signal_wait"
    __table_args__ = (UniqueConstraint("trigger_id", "branch"),)

    # (An id of its own: `deferral rotate-fernet-key` re-seals ``fired`` by it.)
    id: Mapped[int] = _id()
    trigger_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("trigger.id", ondelete="CASCADE")
    )
    # '' for a plain signal wait; a branch's name in an AnyOf / AllOf; CANCEL_BRANCH for the
    # ``cancel_on`` of a deferral (deferral.store.waits).
    branch: Mapped[str] = mapped_column(Text, server_default="")
    key: Mapped[str] = mapped_column(Text, index=True)
    created_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, server_default=func.clock_timestamp()
    )
    # The payload filter (``SignalTrigger(where=)``) as a jsonpath predicate, in clear as the key
    # is; NULL: every signal on the key matches.
    match: Mapped[str | None] = mapped_column(Text)
    # Of a cancel-on row: the state its task ends in ('skipped' or 'failed').
    cancels: Mapped[str | None] = mapped_column(Text)
    # True when the rows are the whole wait: nothing of it is published to a triggerer.
    holds: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    # Of an all-of's branch that fired: its payload, sealed as an event.
    fired: Mapped[str | None] = mapped_column(Text)


class WaitTimer(Base):
    """The one timer of a composite wait held as rows (deferral.store.waits): an any-of's
    earliest time branch, an all-of's latest. Goes with its trigger row."""

    __tablename__ = "wait_timer"

    trigger_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("trigger.id", ondelete="CASCADE"), primary_key=True
    )
    branch: Mapped[str] = mapped_column(Text)
    due_at: Mapped[dt.datetime] = mapped_column(Timestamp, index=True)
    # True when the rows are the whole wait (as signal_wait.holds).
    holds: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))


class TriggerProgress(Base):
    """What a trigger reported before its event (``TriggerProgress``), per try of each task
    waiting on it: the last ``progress.KEPT`` kept, numbered from 1 (scheduler.progress)."""

    __tablename__ = "trigger_progress"
    __table_args__ = (UniqueConstraint("task_instance_id", "try_number", "seq"),)

    # (An id of its own: `deferral rotate-fernet-key` re-seals ``payload`` by it.)
    id: Mapped[int] = _id()
    task_instance_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("task_instance.id", ondelete="CASCADE")
    )
    try_number: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    recorded_at: Mapped[dt.datetime] = _created()
    payload: Mapped[str] = mapped_column(Text)  # Fernet token of its JSON


class CallbackHeartbeat(Base):
    """The heartbeat deadline of a callback wait (``CallbackTrigger(heartbeat=)``): each
    heartbeat posted to its token pushes ``due_at`` on by ``every_sec``; the scheduler's bounded
    pass fails the task of one past due. Goes with its trigger row."""

    __tablename__ = "callback_heartbeat"

    trigger_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("trigger.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(Text, primary_key=True, index=True)
    every_sec: Mapped[float] = mapped_column(Float)
    due_at: Mapped[dt.datetime] = mapped_column(Timestamp, index=True)


class AssetModel(Base):
    """An asset some parsed DAG names (in a schedule, an inlet or an outlet), as last parsed."""

    __tablename__ = "asset"
    __table_args__ = (Index(None, "uri"),)

    name: Mapped[str] = mapped_column(String(1000), primary_key=True)
    uri: Mapped[str] = mapped_column(String(1000))
    group: Mapped[str] = mapped_column(String(1000), server_default=text("'asset'"))
    # False while another asset, recorded first, holds the same URI (Airflow's assets are
    # unique by name and by URI): tasks naming it fail before they run.
    active: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    updated_at: Mapped[dt.datetime] = _created()


class AssetEventRow(Base):
    """An update of an asset: by a task that succeeded with it in its outlets (source_*), or by
    a watcher's event (``watcher``, deduplicated by ``dedup_key`` per asset)."""

    __tablename__ = "asset_event"
    __table_args__ = (
        UniqueConstraint("asset_name", "dedup_key"),
        Index(None, "asset_name", "id"),
    )

    id: Mapped[int] = _id()
    asset_name: Mapped[str] = mapped_column(String(1000))
    extra: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    source_dag_id: Mapped[str | None] = mapped_column(String(250))
    source_run_id: Mapped[str | None] = mapped_column(String(250))
    source_task_id: Mapped[str | None] = mapped_column(String(250))
    source_map_index: Mapped[int] = mapped_column(Integer, server_default=text("-1"))
    watcher: Mapped[str | None] = mapped_column(String(1000))
    dedup_key: Mapped[str | None] = mapped_column(String(250))
    # The partition of the asset the event updated: its run's key, or one the task added.
    partition_key: Mapped[str | None] = mapped_column(String(250))
    timestamp: Mapped[dt.datetime] = _created()


class DagScheduleAsset(Base):
    """A DAG whose schedule names an asset (as last parsed): its events queue for the DAG."""

    __tablename__ = "dag_schedule_asset"

    dag_id: Mapped[str] = mapped_column(String(250), primary_key=True)
    asset_name: Mapped[str] = mapped_column(String(1000), primary_key=True, index=True)


class TaskOutletAsset(Base):
    """A task with an asset in its ``outlets`` (as last parsed)."""

    __tablename__ = "task_outlet_asset"

    dag_id: Mapped[str] = mapped_column(String(250), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(250), primary_key=True)
    asset_name: Mapped[str] = mapped_column(String(1000), primary_key=True)


class AssetDagRunQueue(Base):
    """An asset event not yet consumed by a run of a DAG scheduled on its asset."""

    __tablename__ = "asset_dag_run_queue"

    target_dag_id: Mapped[str] = mapped_column(String(250), primary_key=True)
    asset_event_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    asset_name: Mapped[str] = mapped_column(String(1000))


class DagRunAssetEvent(Base):
    """The asset events a run consumed: its ``triggering_asset_events``."""

    __tablename__ = "dag_run_asset_event"

    dag_run_id: Mapped[int] = mapped_column(
        ForeignKey("dag_run.id", ondelete="CASCADE"), primary_key=True
    )
    asset_event_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class AssetWatcherRow(Base):
    """An ``AssetWatcher`` of an asset in a parsed DAG's schedule: the event trigger (classpath
    and sealed kwargs) a triggerer runs while it holds the lease and the DAG is active."""

    __tablename__ = "asset_watcher"
    __table_args__ = (UniqueConstraint("dag_id", "asset_name", "name"),)

    id: Mapped[int] = _id()
    dag_id: Mapped[str] = mapped_column(String(250))
    asset_name: Mapped[str] = mapped_column(String(1000))
    name: Mapped[str] = mapped_column(String(1000))
    classpath: Mapped[str] = mapped_column(String(1000))
    kwargs: Mapped[str] = mapped_column(Text)  # Fernet token of the serialized kwargs
    triggerer_id: Mapped[str | None] = mapped_column(String(250))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)


class AssetAliasAsset(Base):
    """An asset an alias resolved to: a task added an event of it through the alias. A DAG
    scheduled on the alias is queued the asset's events from then on."""

    __tablename__ = "asset_alias_asset"

    alias_name: Mapped[str] = mapped_column(String(1000), primary_key=True)
    asset_name: Mapped[str] = mapped_column(String(1000), primary_key=True, index=True)


class AssetAliasEvent(Base):
    """An asset event a task added through an alias: the alias's ``inlet_events``."""

    __tablename__ = "asset_alias_event"

    alias_name: Mapped[str] = mapped_column(String(1000), primary_key=True)
    asset_event_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class TaskStateRow(Base):
    """A key of a task instance's state store (``context["task_state_store"]``), kept across
    its tries until it expires (``expires_at``; None: never) or the run is pruned."""

    __tablename__ = "task_state"

    task_instance_id: Mapped[int] = mapped_column(
        ForeignKey("task_instance.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    value: Mapped[Any] = mapped_column(JSONB)
    expires_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    updated_at: Mapped[dt.datetime] = _created()


class AssetStateRow(Base):
    """A key of an asset's state store (``context["asset_state_store"][asset]``), kept across
    runs."""

    __tablename__ = "asset_state"

    asset_name: Mapped[str] = mapped_column(String(1000), primary_key=True)
    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    value: Mapped[Any] = mapped_column(JSONB)
    updated_at: Mapped[dt.datetime] = _created()
