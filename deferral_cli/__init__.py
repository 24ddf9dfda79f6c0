"""The ``deferral`` command: database, DAGs, runs, and a standalone mode for trying it out."""

from __future__ import annotations

from deferral.runtime.process import command_group
from deferral_cli import (
    approvals,
    assets,
    connections,
    dags,
    dagtest,
    db,
    dead,
    health,
    inspect,
    keys,
    runs,
    schedules,
    signals,
    standalone,
    tasks,
    triggers,
    users,
    variables,
    webserver,
    xcom,
)
from deferral_cli.common import DeferralGroup


@command_group(cls=DeferralGroup)
def main() -> None:
    """deferral: a workflow runtime whose tasks can defer their waits to triggers.

    Exit status: 0 done, 1 failed (a run failed, a thing named does not exist...), 2 a usage
    error or PostgreSQL / Redis cannot be reached, 3 `dags trigger --wait` timed out.
    """


main.add_command(db.db)
main.add_command(dags.dags)
for command in (
    schedules.dags_pause,
    schedules.dags_unpause,
    schedules.dags_backfill,
    schedules.dags_next_run,
    dagtest.dags_test,
):
    dags.dags.add_command(command)
main.add_command(runs.runs)
main.add_command(tasks.tasks)
tasks.tasks.add_command(dagtest.tasks_test)
main.add_command(xcom.xcom)
main.add_command(approvals.approvals)
main.add_command(triggers.triggers)
main.add_command(assets.assets)
main.add_command(triggers.triggerers)
main.add_command(triggers.workers)
main.add_command(inspect.streams)
main.add_command(inspect.reshard_streams)
main.add_command(dead.dead)
main.add_command(inspect.doctor_command)
main.add_command(health.health_command)
main.add_command(keys.rotate_fernet_key)
main.add_command(standalone.standalone)
main.add_command(variables.variables)
main.add_command(connections.connections)
main.add_command(users.users)
main.add_command(webserver.webserver_command)
main.add_command(signals.signals_group)

__all__ = ["main"]
