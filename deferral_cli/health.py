"""``deferral health``: a container healthcheck; the decisions are in deferral_cli.health_checks."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import click
from redis.exceptions import RedisClusterException, RedisError
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from broker import topology
from broker.client import redis_location
from deferral.runtime.config import (
    ConfigError,
    Settings,
    load_settings,
    webserver_host,
    webserver_port,
)
from deferral.store.db import location, make_engine, make_sessionmaker
from deferral.store.doctor import Check, Status, exit_code
from deferral_cli import health_checks
from deferral_cli.common import server_error


@click.command("health")
@click.option(
    "--service",
    type=click.Choice([*sorted(health_checks.PROCESSES), health_checks.WEBSERVER]),
    default=None,
    help="Also check that this process kind, named --name, heartbeats (webserver: that its"
    " health page answers on DEFERRAL_WEBSERVER_HOST / DEFERRAL_WEBSERVER_PORT; no --name).",
)
@click.option("--name", default=None, help="The --name the checked process was started with.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds to wait for each server's answer.",
)
def health_command(service: str | None, name: str | None, timeout: float) -> None:
    """Exit 0 if Postgres and Redis answer and, with --service and --name, that process's
    heartbeat is fresh (at most 2.1 x DEFERRAL_HEARTBEAT_SEC old); else exit 1.

    Prints one line per check, `ok|fail  <check>: <detail>`. Meant for container healthchecks:

    \b
      deferral health --service worker --name worker-1
      deferral health --service webserver

    Exit 1 also when a server does not answer or a setting is bad (never 2, which Docker
    reserves).
    """
    web = service == health_checks.WEBSERVER
    if web and name is not None:
        raise click.UsageError("--service webserver takes no --name")
    if not web and (service is None) != (name is None):
        raise click.UsageError("--service and --name go together")
    try:
        settings = load_settings()
    except ConfigError as exc:
        checks = [Check(Status.FAIL, "settings", str(exc))]
    else:
        checks = _postgres_checks(settings, None if web else service, name, timeout)
        checks.append(_redis_check(settings, timeout))
        if web:
            checks.append(_webserver_check(timeout))
    for check in checks:
        click.echo(check.line())
    sys.exit(exit_code(checks))


def _postgres_checks(
    settings: Settings, service: str | None, name: str | None, timeout: float
) -> list[Check]:
    # A server that accepts connections but cannot answer is not healthy either.
    engine = make_engine(settings.database_url, timeout_sec=timeout, poolclass=NullPool)
    where = location(engine)
    try:
        with make_sessionmaker(engine)() as session:
            now = session.scalars(select(func.now())).one()
            if service is None or name is None:
                return [health_checks.server("postgres", where, None)]
            model = health_checks.PROCESSES[service]
            row = session.execute(
                select(model.state, model.latest_heartbeat).where(model.name == name)
            ).one_or_none()
    except SQLAlchemyError as exc:
        return [_unanswered("postgres", where, exc, settings)]
    finally:
        engine.dispose()
    beat = None if row is None else health_checks.Beat(row.state, row.latest_heartbeat)
    return [
        health_checks.server("postgres", where, None),
        health_checks.heartbeat(service, name, beat, now, settings.heartbeat_sec),
    ]


def _redis_check(settings: Settings, timeout: float) -> Check:
    where = redis_location(settings.redis_url)
    options = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
    client = None
    try:  # a cluster client asks its nodes for the slot map as it is made
        client = topology.client(settings.redis_url, options, max_connections=2)
        client.ping()
    except (RedisError, RedisClusterException) as exc:
        return _unanswered("redis", where, exc, settings)
    finally:
        if client is not None:
            client.close()
    return health_checks.server("redis", where, None)


def _webserver_check(timeout: float) -> Check:
    try:
        url = health_checks.webserver_url(webserver_host(), webserver_port())
    except ConfigError as exc:
        return Check(Status.FAIL, health_checks.WEBSERVER, str(exc))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            status = answer.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except OSError as exc:  # URLError (refused, unknown host) and timeouts
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        said = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
        return health_checks.webserver(url, said)
    return health_checks.webserver(url, None if status == 200 else f"HTTP {status}")


def _unanswered(name: str, where: str, exc: BaseException, settings: Settings) -> Check:
    """The failed check of a server, in the words every other command uses for it."""
    said = server_error(exc, settings)
    if said is not None:
        return Check(Status.FAIL, name, said[0])
    return health_checks.server(name, where, _first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
