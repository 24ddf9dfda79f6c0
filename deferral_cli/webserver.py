"""``deferral webserver``: the web UI (the application itself is the ``webserver`` package)."""

from __future__ import annotations

import logging
import socket

import click
from sqlalchemy import func, select

from broker.client import Broker, RedisSetupError
from deferral.runtime.config import ConfigError, webserver_host, webserver_port, webserver_settings
from deferral.runtime.process import (
    log_format_option,
    metrics_host_option,
    metrics_port_option,
    serve_metrics_or_exit,
    settings_or_exit,
    setup_logging,
)
from deferral.store.tables import User
from deferral_cli.common import EXIT_UNAVAILABLE, fail, sessions
from webserver import users

log = logging.getLogger("deferral.webserver")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port``, or OSError saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@click.command("webserver")
@click.option(
    "--host",
    default=None,
    help="Address to listen on [default: DEFERRAL_WEBSERVER_HOST, else 127.0.0.1]. Pages open"
    " without a login only on a loopback address.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port to listen on [default: DEFERRAL_WEBSERVER_PORT, else 8080].",
)
@metrics_port_option
@metrics_host_option
@log_format_option
def webserver_command(
    host: str | None, port: int | None, metrics_port: int | None, metrics_host: str, log_format: str
) -> None:
    """Serve the web UI: DAGs, their grid and graph, task instances and their logs, what is
    deferred now, triggerers, streams and the doctor's checklist; and a JSON API under
    /api/v1/.

    Reading needs no login when listening on 127.0.0.1 (the default); trigger, pause, clear
    and mark always need one: a user made with `deferral users create`, or `admin` with the
    password in DEFERRAL_WEBSERVER_ADMIN_PASSWORD.
    """
    setup_logging(log_format)
    settings = settings_or_exit()
    try:
        host = host if host is not None else webserver_host()
        port = port if port is not None else webserver_port()
        webserver_settings()
        admin_password = users.admin_password()
    except ConfigError as exc:
        fail(str(exc), EXIT_UNAVAILABLE)
        return
    if admin_password is not None:
        try:
            users.check_password(admin_password)
        except users.UserError as exc:
            fail(f"{users.ADMIN_PASSWORD_ENV} is too short: {exc}", EXIT_UNAVAILABLE)
    # Both servers must answer now (an unreachable one ends the command in one line); pages
    # that find one gone later say so themselves.
    with sessions(settings)() as session:
        users_count = session.scalar(select(func.count()).select_from(User)) or 0
    try:
        Broker.from_url(
            settings.redis_url, settings.stream_prefix, shards=settings.stream_shards
        ).close()
    except RedisSetupError as exc:
        fail(f"Redis: {exc}", EXIT_UNAVAILABLE)
    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_UNAVAILABLE)
        return
    # Imported here: `deferral --help` and every other command stay free of the web stack.
    import uvicorn

    from deferral.runtime import metrics
    from webserver.access_log import mask_access_log
    from webserver.app import create_app
    from webserver.auth import is_loopback

    # Pages need a login off loopback, and behind a proxy (allowed hosts) on loopback too.
    needs_login = not is_loopback(host) or bool(webserver_settings().allowed_hosts)
    if needs_login and users_count == 0 and users.admin_password() is None:
        log.warning(
            "nobody can log in: create a user with `deferral users create NAME` or set %s",
            users.ADMIN_PASSWORD_ENV,
        )
    serve_metrics_or_exit(metrics.WEBSERVER, metrics_port, metrics_host)
    app = create_app(settings, host=host)
    where = f"[{host}]" if ":" in host else host
    log.info("web UI at http://%s:%d/", where, port)
    mask_access_log()  # a callback's path holds its token
    config = uvicorn.Config(app, log_config=None, server_header=False, access_log=True)
    uvicorn.Server(config).run(sockets=[sock])
