"""``triggerer consume``."""

from __future__ import annotations

import dataclasses

import anyio
import click

from deferral.runtime.process import (
    command_group,
    default_consumer_name,
    log_format_option,
    metrics_host_option,
    metrics_port_option,
    queues_value,
    serve_metrics_or_exit,
    settings_or_exit,
    setup_logging,
)


@command_group()
def main() -> None:
    """The deferral triggerer: runs triggers for deferred tasks."""


@main.command()
@click.option(
    "--capacity",
    type=click.IntRange(min=1),
    default=None,
    help="Triggers run at once (default: DEFERRAL_TRIGGERER_CAPACITY, 1000).",
)
@click.option(
    "--heartbeat",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds between heartbeats (default: DEFERRAL_HEARTBEAT_SEC, 5).",
)
@click.option(
    "--name",
    default=None,
    help="Consumer name; a stable name lets a restart resume its own entries.",
)
@click.option(
    "--queues",
    default=None,
    callback=queues_value,
    help="Comma-separated task queues whose triggers to run (default: every queue).",
)
@log_format_option
@metrics_port_option
@metrics_host_option
def consume(
    capacity: int | None,
    heartbeat: float | None,
    name: str | None,
    queues: tuple[str, ...] | None,
    log_format: str,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run triggers from deferral:triggers (and deferral:triggers:<queue>) until SIGTERM."""
    from triggerer.service import TriggererService

    setup_logging(log_format)
    settings = settings_or_exit()
    serve_metrics_or_exit("triggerer", metrics_port, metrics_host)
    if heartbeat is not None:
        settings = dataclasses.replace(settings, heartbeat_sec=heartbeat)
    service = TriggererService(
        settings,
        capacity=capacity or settings.triggerer_capacity,
        name=name or default_consumer_name(),
        queues=queues,
    )
    anyio.run(service.run)
