"""``deferral doctor`` and ``deferral streams``: what the read model finds, printed."""

from __future__ import annotations

import contextlib
import sys

import click
from sqlalchemy import select

from broker.client import Broker, RedisSetupError
from broker.reshard import reshard
from deferral.runtime.process import settings_or_exit
from deferral.runtime.redis_urls import MAX_STREAM_SHARDS
from deferral.store import doctor as checklist
from deferral.store.liveness import alive_clause
from deferral.store.tables import Scheduler, Triggerer, Worker
from deferral_cli.common import emit, fail, output_options, sessions
from readmodel.doctor import gather_checks
from readmodel.streams import stream_records


@click.command("doctor")
@output_options
def doctor_command(output: str) -> None:
    """Check why deferred tasks may be stuck; exit 1 if any check fails (2 if PostgreSQL or
    Redis cannot be reached at all).

    Prints one line per check, `ok|warn|fail  <check>: <detail>` (with --output json, an object
    per check: status, check, detail):

    \b
    triggerer alive     deferred tasks, but no triggerer heartbeating (fail)
    capacity            alive triggerers' capacity below the deferred tasks (warn)
    expired timeouts    deferrals over 10 s past their timeout: no scheduler (fail)
    orphaned triggers   triggers no task waits on (warn); deferred tasks
                        whose trigger row is missing (fail)
    unpublished outbox  outbox rows unpublished for over 30 s: no relay (fail)
    broken DAGs         DAGs that stopped loading while they have runs (warn;
                        fail once their grace period is over)
    import errors       DAG files the scheduler could not load (warn)
    dead letters        entries in the dead-letter stream (warn)
    in flight           deferred tasks whose trigger is in no stream (fail)
    """
    checks = gather_checks(settings_or_exit())
    if output == "json":
        emit(
            output,
            [{"status": c.status, "check": c.name, "detail": c.detail} for c in checks],
            empty="",
        )
    else:
        for check in checks:
            click.echo(check.line())
    sys.exit(checklist.exit_code(checks))


@click.command()
@output_options
def streams(output: str) -> None:
    """Show each stream's length, its consumer groups, their lag and pending entries per consumer.

    Covers the triggers, events and dead streams and every queue stream (named in the set
    `<prefix>:queues`, never found by a keyspace scan): a row per consumer group (one row for a
    stream without a group). LAG is "-" where Redis does not report it (before Redis 7, or when
    it cannot tell). `deferral dead list` shows the dead letters themselves.
    """
    settings = settings_or_exit()
    try:
        broker = Broker.from_url(
            settings.redis_url, settings.stream_prefix, shards=settings.stream_shards
        )
    except RedisSetupError as exc:
        fail(f"Redis: {exc}")
        return
    try:
        records = stream_records(broker)
    finally:
        broker.close()
    emit(output, records, empty="no streams")


@click.command("reshard-streams")
@click.option(
    "--shards",
    type=click.IntRange(1, MAX_STREAM_SHARDS),
    required=True,
    help="The new shard count (set DEFERRAL_STREAM_SHARDS to it before starting services).",
)
def reshard_streams(shards: int) -> None:
    """Change the shard count of the triggers and events streams (DEFERRAL_STREAM_SHARDS), with
    every scheduler, worker and triggerer stopped.

    Moves each pending trigger and event entry to the stream of its new shard and records the
    new count; then start the services with DEFERRAL_STREAM_SHARDS set to it. Refuses while any
    service heartbeats. Prints `moved <n> entries (<m> naming no trigger dropped): <old> -> <new>
    shards`.
    """
    settings = settings_or_exit()
    with sessions(settings)() as session:
        alive = [
            name
            for model in (Scheduler, Worker, Triggerer)
            for name in session.scalars(
                select(model.name).where(alive_clause(model, settings.heartbeat_sec))
            )
        ]
    if alive:
        fail(f"stop every service first: {', '.join(sorted(alive)[:5])} still heartbeat(s)")
    url, prefix = settings.redis_url, settings.stream_prefix
    try:
        probe = Broker.from_url(url, prefix, shards=shards, check_shards=False)
    except RedisSetupError as exc:
        fail(f"Redis: {exc}")
        return
    with contextlib.closing(probe):
        recorded = probe.recorded_shards()
    old = Broker.from_url(url, prefix, shards=recorded or shards, check_shards=False)
    new = Broker.from_url(url, prefix, shards=shards, check_shards=False)
    with contextlib.closing(old), contextlib.closing(new):
        done = reshard(old, new)
    click.echo(
        f"moved {done.moved} entries ({done.dropped} naming no trigger dropped):"
        f" {recorded or shards} -> {shards} shards"
    )
