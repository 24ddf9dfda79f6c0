"""``deferral standalone``: all services at once; the process helpers are in embedded.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import click

from broker.client import Broker, RedisSetupError
from deferral.runtime.config import Settings, webserver_port
from deferral.runtime.process import settings_or_exit
from deferral.states import DagRunState
from deferral.store import migrate
from deferral_cli import embedded as embedded
from deferral_cli import health_checks
from deferral_cli.common import EXIT_FAILED, EXIT_TIMED_OUT, fail, run_conf, sessions
from deferral_cli.dags import trigger
from deferral_cli.runs import show_run
from deferral_cli.wait import wait_for_run
from readmodel import dags as readmodel_dags
from webserver import users


@click.command()
@click.option("--dags-folder", default=None, help="DAGs folder (default: DEFERRAL_DAGS_FOLDER).")
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=".deferral",
    show_default=True,
    help="Where the embedded servers' data, their ports and the Fernet key are kept.",
)
@click.option(
    "--run",
    "run_dag",
    default=None,
    metavar="DAG_ID",
    help="Trigger DAG_ID, show how it went, and stop (exit 1 if it failed, 3 on --timeout).",
)
@click.option(
    "-c",
    "--conf",
    "conf_json",
    default=None,
    help="With --run: the run's configuration, a JSON object.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=300,
    show_default=True,
    help="With --run: give up after S seconds.",
)
def standalone(
    dags_folder: str | None,
    home: Path,
    run_dag: str | None,
    conf_json: str | None,
    timeout: float,
) -> None:
    """Run scheduler, triggerer, worker and (without --run) the web UI together, for trying
    deferral out.

    Unset settings are filled in: an embedded PostgreSQL (data in HOME/pgdata) and Redis (on a
    port kept in HOME/redis.port), started now and stopped at the end (with the `standalone`
    extra installed; without it, the local servers on 127.0.0.1), and a Fernet key kept in
    HOME/fernet.key. Without --run it prints the `export` lines that let another terminal's
    `deferral` commands reach the same servers and the web UI's address (port 8080, else the
    one kept in HOME/webserver.port; admin's password in HOME/webserver-admin.password unless
    DEFERRAL_WEBSERVER_ADMIN_PASSWORD is set), then runs until Ctrl-C.
    """

    conf = run_conf(conf_json)  # refused before any server starts
    if conf_json is not None and run_dag is None:
        raise click.BadParameter("only means something with --run", param_hint="--conf")

    def say(message: str) -> None:
        click.echo(f"note: {message}", err=True)

    with _holding_or_exit(home), embedded.environment(dags_folder, home, say) as filled:
        settings = settings_or_exit()
        migrate.upgrade(settings.database_url)
        # The services would wait for an unreachable Redis; say so now instead.
        try:
            Broker.from_url(
                settings.redis_url, settings.stream_prefix, shards=settings.stream_shards
            ).close()
        except RedisSetupError as exc:
            fail(f"Redis: {exc}")
        # Said once both servers answer: a server that does not is the one line shown instead.
        click.echo(f"# deferral standalone: {filled.summary()}")
        with embedded.running_services(webserver=run_dag is None) as procs:
            if run_dag is None:
                # Held from before "services running" is said: a SIGTERM sent on reading it
                # must stop the servers, not kill this process and leave them running.
                stop_signals = {signal.SIGINT, signal.SIGTERM}
                signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
                click.echo("# deferral standalone: in another terminal, to reach these servers:")
                for line in embedded.environment_lines(os.environ, filled.key_file):
                    click.echo(line)
                _say_web_ui(procs[-1], filled.admin_password_file)
                click.echo("services running; Ctrl-C stops them")
                ended = _until_stopped_or_one_exits(procs, stop_signals)
                if ended is not None:
                    fail(
                        f"the {embedded.service_name(ended)} service exited (exit code "
                        f"{ended.returncode}); stopped the others"
                    )
                return
            _wait_for_the_first_parse(settings, procs, timeout)
            run_id = trigger(settings, run_dag, conf, None)
            state = wait_for_run(sessions(settings), run_dag, run_id, timeout)
            show_run(settings, run_dag, run_id, history=True)
            if any(proc.poll() is not None for proc in procs):
                fail("a service process exited early; see its log above")
    if state is None:
        fail(f"run {run_id} of DAG {run_dag} not finished after {timeout:g}s", EXIT_TIMED_OUT)
    sys.exit(0 if state == DagRunState.SUCCESS else EXIT_FAILED)


SERVICE_CHECK_SEC = 0.5
# How often `--run` looks whether the scheduler has parsed the DAGs folder yet.
PARSE_POLL_SEC = 0.2


def _wait_for_the_first_parse(
    settings: Settings, procs: list[subprocess.Popen[bytes]], timeout: float
) -> None:
    """Until the scheduler recorded its first parse of the DAGs folder (what `dags trigger`
    reads: readmodel rule 5), or a service exits, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        with sessions(settings)() as session:
            if readmodel_dags.not_parsed_notice(session) is None:
                return
        if any(proc.poll() is not None for proc in procs):
            fail("a service process exited early; see its log above")
        if time.monotonic() >= deadline:
            fail(f"no parse of the DAGs folder after {timeout:g}s", EXIT_TIMED_OUT)
        time.sleep(PARSE_POLL_SEC)


@contextmanager
def _holding_or_exit(home: Path) -> Iterator[None]:
    """Hold ``home`` for this stack, or exit 1 naming the stack that holds it."""
    with ExitStack() as held:
        try:
            held.enter_context(embedded.holding_home(home))
        except embedded.HomeInUse as exc:
            fail(str(exc))
        yield


def _until_stopped_or_one_exits(
    procs: list[subprocess.Popen[bytes]], stop_signals: set[signal.Signals]
) -> subprocess.Popen[bytes] | None:
    """Wait for Ctrl-C or SIGTERM (None), or for a service to exit on its own (that one): a
    stack missing a service must not go on saying it runs."""
    while signal.sigtimedwait(stop_signals, SERVICE_CHECK_SEC) is None:
        for proc in procs:
            if proc.poll() is not None:
                return proc
    return None


def _say_web_ui(proc: subprocess.Popen[bytes], password_file: Path | None) -> None:
    """Print the web UI's address once it answers, and how to log in (never the password)."""
    port = webserver_port()
    url = f"http://127.0.0.1:{port}/"
    if not embedded.wait_for_webserver(health_checks.webserver_url("127.0.0.1", port), proc):
        click.echo(f"note: the web UI did not start on port {port}; see its log above", err=True)
        return
    click.echo(f"# web UI: {url}")
    if password_file is not None:
        click.echo(f"#   to act there, log in as admin with the password in {password_file}")
    else:
        click.echo(f"#   to act there, log in as admin with {users.ADMIN_PASSWORD_ENV}")
