"""The numbers behind ``deferral doctor`` and the web UI's Doctor page, gathered from PostgreSQL and
Redis; the checks themselves are in deferral.store.doctor."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session

from broker.client import Broker, RedisSetupError
from broker.streams import task_label
from deferral import signals
from deferral.runtime.config import Settings
from deferral.states import DagRunState, TaskState
from deferral.store import doctor as checklist
from deferral.store import far_timers, liveness, queues
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import (
    Dag,
    DagImportError,
    DagRun,
    Outbox,
    TaskInstance,
    Trigger,
    Triggerer,
)


def doctor_record(settings: Settings) -> dict[str, object]:
    """The doctor's checks as the web UI shows them, and whether any failed."""
    checks = gather_checks(settings)
    return {
        "status": "fail" if checklist.exit_code(checks) else "ok",
        "checks": [{"status": c.status, "check": c.name, "detail": c.detail} for c in checks],
    }


def gather_checks(settings: Settings) -> list[checklist.Check]:
    """Every check of the checklist, on the numbers Postgres and Redis give now (the web UI's
    Doctor page shows the same list)."""
    with make_sessionmaker(make_engine(settings.database_url))() as session:
        checks = _database_checks(session, settings)
    try:
        broker = Broker.from_url(
            settings.redis_url, settings.stream_prefix, shards=settings.stream_shards
        )
    except RedisSetupError as exc:
        checks.append(checklist.Check(checklist.Status.FAIL, "redis", str(exc)))
    else:
        try:
            checks += _redis_checks(broker, settings)
        finally:
            broker.close()
    return checks


def _database_checks(session: Session, settings: Settings) -> list[checklist.Check]:
    """Gather the numbers the Postgres checks decide on; ages use the database's clock."""
    ti = TaskInstance
    deferred_state = ti.state == TaskState.DEFERRED
    now: dt.datetime = session.scalars(select(func.now())).one()
    stale_after = liveness.stale_after_sec(settings.heartbeat_sec)
    deferred = session.scalar(select(func.count()).select_from(ti).where(deferred_state)) or 0
    # Far timers not yet published take no triggerer's capacity until their moment is near.
    far = (
        session.scalar(
            select(func.count())
            .select_from(ti)
            .where(deferred_state, ~far_timers.published(ti.trigger_id))
        )
        or 0
    )

    alive: list[Triggerer] = []
    stale: list[tuple[str, float]] = []
    for triggerer in session.scalars(select(Triggerer).order_by(Triggerer.name)):
        age = liveness.heartbeat_age_sec(triggerer.latest_heartbeat, now)
        if liveness.is_alive(
            triggerer.state, triggerer.latest_heartbeat, now, settings.heartbeat_sec
        ):
            alive.append(triggerer)
        else:
            name = triggerer.name
            stale.append(
                (name if triggerer.state == "running" else f"{name} ({triggerer.state})", age)
            )

    grace = dt.timedelta(seconds=checklist.EXPIRED_GRACE_SEC)
    expired, oldest_timeout = session.execute(
        select(func.count(), func.min(ti.trigger_timeout)).where(
            deferred_state, ti.trigger_timeout < func.now() - grace
        )
    ).one()

    orphans = session.scalars(
        select(Trigger.id).where(~exists().where(ti.trigger_id == Trigger.id)).order_by(Trigger.id)
    ).all()
    stranded = session.execute(
        select(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
        .outerjoin(Trigger, Trigger.id == ti.trigger_id)
        .where(deferred_state, Trigger.id.is_(None))
        .order_by(ti.id)
    ).all()

    stale_outbox = dt.timedelta(seconds=checklist.OUTBOX_STALE_SEC)
    unpublished, oldest_row = session.execute(
        select(func.count(), func.min(Outbox.created_at)).where(
            Outbox.published_at.is_(None), Outbox.created_at < func.now() - stale_outbox
        )
    ).one()

    broken = [
        checklist.BrokenDag(dag_id, max(0.0, (now - since).total_seconds()), reason or "", runs)
        for dag_id, since, reason, runs in session.execute(
            select(
                Dag.dag_id,
                Dag.missing_since,
                Dag.missing_reason,
                select(func.count())
                .where(DagRun.dag_id == Dag.dag_id, DagRun.state == DagRunState.RUNNING)
                .scalar_subquery(),
            )
            .where(Dag.missing_since.is_not(None))
            .order_by(Dag.dag_id)
        )
        if runs
    ]

    return [
        checklist.triggerer_alive(deferred, [t.name for t in alive], stale, stale_after),
        checklist.capacity(deferred - far, sum(t.capacity for t in alive), len(alive)),
        queues.queues_served(_unserved_waiting(session, [t.queues for t in alive])),
        checklist.expired_timeouts(expired, _age_seconds(now, oldest_timeout)),
        checklist.orphaned_triggers(list(orphans), [task_label(*row) for row in stranded]),
        checklist.unpublished_outbox(unpublished, _age_seconds(now, oldest_row)),
        checklist.broken_dags(broken, settings.dag_import_grace_sec),
        checklist.import_errors(
            [
                checklist.FailingFile(row.filename, row.error)
                for row in session.scalars(select(DagImportError).order_by(DagImportError.filename))
            ]
        ),
    ]


def _unserved_waiting(session: Session, served: list[str | None]) -> list[queues.Waiting]:
    """The deferred tasks of each queue no live triggerer serves, a few triggers named."""
    ti = TaskInstance
    deferred = ti.state == TaskState.DEFERRED
    counts = session.execute(
        select(ti.queue, func.count()).where(deferred).group_by(ti.queue).order_by(ti.queue)
    ).all()
    waiting = []
    for queue, count in counts:
        if not queues.unserved(queue, served):
            continue
        rows = session.execute(
            select(ti.trigger_id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
            .where(deferred, ti.queue == queue)
            .order_by(ti.id)
            .limit(queues.NAMED_PER_QUEUE)
        ).all()
        named = [f"trigger {row.trigger_id} ({task_label(*row[1:])})" for row in rows]
        waiting.append(queues.Waiting(queue, count, named))
    return waiting


def _age_seconds(now: dt.datetime, moment: dt.datetime | None) -> float | None:
    return None if moment is None else max(0.0, (now - moment).total_seconds())


def _redis_checks(broker: Broker, settings: Settings) -> list[checklist.Check]:
    dead = broker.keys.dead
    length = int(broker.redis.xlen(dead))
    newest_error = None
    newest = broker.newest(dead) if length else []
    if newest:
        raw = newest[0].fields.get(b"error")
        newest_error = None if raw is None else raw.decode(errors="replace")
    return [
        checklist.dead_letters(dead, length, newest_error),
        checklist.in_flight(_not_in_flight(broker, settings)),
    ]


# A trigger published by a worker reaches its stream right after the worker's commit.
_JUST_DEFERRED = dt.timedelta(seconds=5)


def _not_in_flight(broker: Broker, settings: Settings) -> list[str]:
    """Labels of deferred tasks whose trigger is in no stream (checked for every deferred task,
    a page at a time: this is run on demand)."""
    ti = TaskInstance
    with make_sessionmaker(make_engine(settings.database_url))() as session:
        deferred = session.execute(
            select(ti.trigger_id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.queue).where(
                ti.state == TaskState.DEFERRED,
                ti.trigger_id.is_not(None),
                ti.updated_at < func.now() - _JUST_DEFERRED,
                signals.not_a_wait(ti.trigger_id),  # a send resumes those, no stream entry
                far_timers.published(ti.trigger_id),  # a far timer is published when near
            )
        ).all()
    labels = {str(row.trigger_id): task_label(*row[1:5]) for row in deferred}
    queue_of = {str(row.trigger_id): row.queue for row in deferred}
    missing = [t for t, here in broker.triggers_present(queue_of).items() if not here]
    missing = [t for t, here in broker.events_present(missing).items() if not here]
    return [labels[t] for t in missing]
