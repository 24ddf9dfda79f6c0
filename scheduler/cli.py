"""``scheduler consume``."""

from __future__ import annotations

import click

from deferral.runtime.process import (
    command_group,
    default_consumer_name,
    log_format_option,
    metrics_host_option,
    metrics_port_option,
    serve_metrics_or_exit,
    settings_or_exit,
    setup_logging,
    stop_on_signals,
)


@command_group()
def main() -> None:
    """The deferral scheduler: DAG runs, dispatch, and resuming deferred tasks."""


@main.command()
@click.option("--name", default=None, help="Consumer name (default: host-pid).")
@log_format_option
@metrics_port_option
@metrics_host_option
def consume(name: str | None, log_format: str, metrics_port: int | None, metrics_host: str) -> None:
    """Schedule, dispatch and apply trigger events until SIGTERM."""
    from scheduler.service import SchedulerService

    setup_logging(log_format)
    settings = settings_or_exit()
    serve_metrics_or_exit("scheduler", metrics_port, metrics_host)
    name = name or default_consumer_name()
    SchedulerService(settings, name=name).run(stop_on_signals(f"scheduler {name}"))
