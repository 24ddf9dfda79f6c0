"""``deferral doctor``: gathers the numbers; the checks themselves are in deferral.doctor."""

from __future__ import annotations

import datetime as dt
import sys

import click
from redis.exceptions import RedisError
from sqlalchemy import exists, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from broker.client import Broker, RedisVersionError
from broker.lease import TAKEOVER_HEARTBEATS
from broker.streams import task_label
from deferral import doctor as checklist
from deferral.cli.common import sessions
from deferral.config import Settings
from deferral.models import Outbox, TaskInstance, Trigger, Triggerer
from deferral.process import settings_or_exit
from deferral.states import TaskState


@click.command("doctor")
def doctor_command() -> None:
    """Check why deferred tasks may be stuck; exit 1 if any check fails.

    Prints one line per check, `ok|warn|fail  <check>: <detail>`:

    \b
    triggerer alive     deferred tasks, but no triggerer heartbeating (fail)
    capacity            alive triggerers' capacity below the deferred tasks (warn)
    expired timeouts    deferrals over 10 s past their timeout: no scheduler (fail)
    orphaned triggers   triggers no task waits on (warn); deferred tasks
                        whose trigger row is missing (fail)
    unpublished outbox  outbox rows unpublished for over 30 s: no relay (fail)
    dead letters        entries in the dead-letter stream (warn)
    redis data          the epoch key is missing: Redis lost its data (warn)
    """
    settings = settings_or_exit()
    checks: list[checklist.Check] = []
    try:
        with sessions(settings)() as session:
            checks += _database_checks(session, settings)
    except SQLAlchemyError as exc:
        checks.append(_fail_check("database", f"cannot query Postgres: {_first_line(exc)}"))
    try:
        broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
    except (RedisError, RedisVersionError) as exc:
        checks.append(_fail_check("redis", f"cannot reach Redis: {_first_line(exc)}"))
    else:
        try:
            checks += _redis_checks(broker)
        except RedisError as exc:
            checks.append(_fail_check("redis", f"cannot query Redis: {_first_line(exc)}"))
        finally:
            broker.close()
    for check in checks:
        click.echo(check.line())
    sys.exit(checklist.exit_code(checks))


def _fail_check(name: str, detail: str) -> checklist.Check:
    return checklist.Check(checklist.Status.FAIL, name, detail)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _database_checks(session: Session, settings: Settings) -> list[checklist.Check]:
    """Gather the numbers the Postgres checks decide on; ages use the database's clock."""
    ti = TaskInstance
    deferred_state = ti.state == TaskState.DEFERRED
    now: dt.datetime = session.scalars(select(func.now())).one()
    stale_after = TAKEOVER_HEARTBEATS * settings.heartbeat_sec
    deferred = session.scalar(select(func.count()).select_from(ti).where(deferred_state)) or 0

    alive: list[Triggerer] = []
    stale: list[tuple[str, float]] = []
    for triggerer in session.scalars(select(Triggerer).order_by(Triggerer.name)):
        age = max(0.0, (now - triggerer.latest_heartbeat).total_seconds())
        if triggerer.state == "running" and age <= stale_after:
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

    return [
        checklist.triggerer_alive(deferred, [t.name for t in alive], stale, stale_after),
        checklist.capacity(deferred, sum(t.capacity for t in alive), len(alive)),
        checklist.expired_timeouts(expired, _age_seconds(now, oldest_timeout)),
        checklist.orphaned_triggers(list(orphans), [task_label(*row) for row in stranded]),
        checklist.unpublished_outbox(unpublished, _age_seconds(now, oldest_row)),
    ]


def _age_seconds(now: dt.datetime, moment: dt.datetime | None) -> float | None:
    return None if moment is None else max(0.0, (now - moment).total_seconds())


def _redis_checks(broker: Broker) -> list[checklist.Check]:
    dead = broker.keys.dead
    length = int(broker.redis.xlen(dead))
    newest_error = None
    newest = broker.newest(dead) if length else None
    if newest is not None:
        raw = newest.fields.get(b"error")
        newest_error = None if raw is None else raw.decode(errors="replace")
    epoch = bool(broker.redis.exists(broker.keys.epoch))
    return [
        checklist.dead_letters(dead, length, newest_error),
        checklist.redis_data(broker.keys.epoch, epoch),
    ]
