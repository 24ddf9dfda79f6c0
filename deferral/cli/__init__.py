"""The ``deferral`` command: database, DAGs, runs, and a standalone mode for trying it out."""

from __future__ import annotations

import click

from deferral.cli import dags, db, doctor, keys, runs, standalone, streams, tasks, triggers


@click.group()
def main() -> None:
    """deferral: a workflow runtime whose tasks can defer their waits to triggers."""


main.add_command(db.db)
main.add_command(dags.dags)
main.add_command(runs.runs)
main.add_command(tasks.tasks)
main.add_command(triggers.triggers)
main.add_command(triggers.triggerers)
main.add_command(streams.streams)
main.add_command(doctor.doctor_command)
main.add_command(keys.rotate_fernet_key)
main.add_command(standalone.standalone)

__all__ = ["main"]
