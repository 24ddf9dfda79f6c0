"""``deferral standalone``: all services at once; the process helpers are in deferral.standalone."""

from __future__ import annotations

import signal
import sys

import click

from deferral import migrate
from deferral.cli.common import fail
from deferral.cli.dags import trigger, wait_for_run
from deferral.cli.runs import show_run
from deferral.process import settings_or_exit
from deferral.states import DagRunState


@click.command()
@click.option("--dags-folder", default=None, help="DAGs folder (default: DEFERRAL_DAGS_FOLDER).")
@click.option(
    "--run",
    "run_dag",
    default=None,
    metavar="DAG_ID",
    help="Trigger DAG_ID, show how it went, and stop (exit 1 if it failed).",
)
@click.option(
    "--timeout", type=float, default=300, show_default=True, help="With --run: give up after S s."
)
def standalone(dags_folder: str | None, run_dag: str | None, timeout: float) -> None:
    """Run scheduler, triggerer and worker together, for trying deferral out.

    Unset settings are filled in: an embedded PostgreSQL (data in .deferral/pgdata) and Redis,
    started now and stopped at the end (with the `standalone` extra installed; without it, the
    local servers on 127.0.0.1), and a Fernet key kept in .deferral/fernet.key.
    """
    from deferral import standalone as embedded

    with embedded.environment(dags_folder):
        settings = settings_or_exit()
        migrate.upgrade(settings.database_url)
        with embedded.running_services() as procs:
            if run_dag is None:
                click.echo("services running; Ctrl-C stops them")
                stop_signals = {signal.SIGINT, signal.SIGTERM}
                signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
                signal.sigwait(stop_signals)
                return
            run_id = trigger(settings, run_dag, {}, None)
            state = wait_for_run(settings, run_dag, run_id, timeout)
            show_run(settings, run_dag, run_id, history=True)
            if any(proc.poll() is not None for proc in procs):
                fail("a service process exited early; see its log above")
    sys.exit(0 if state == DagRunState.SUCCESS else 1)
