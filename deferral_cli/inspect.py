"""``deferral doctor`` and ``deferral streams``: what the read model finds, printed."""

from __future__ import annotations

import sys

import click

from broker.client import Broker, RedisVersionError
from deferral import doctor as checklist
from deferral.process import settings_or_exit
from deferral_cli.common import emit, fail, output_options
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
        broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
    except RedisVersionError as exc:
        fail(f"Redis: {exc}")
        return
    try:
        records = stream_records(broker)
    finally:
        broker.close()
    emit(output, records, empty="no streams")
