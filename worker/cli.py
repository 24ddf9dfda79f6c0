"""``worker consume``."""

from __future__ import annotations

import click

from deferral.config import smtp_settings
from deferral.dag import check_id
from deferral.process import (
    command_group,
    default_consumer_name,
    loaded_or_exit,
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
    """The deferral worker: runs task attempts."""


@main.command()
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Task attempts run at once, each in its own child process.",
)
@click.option(
    "--queue",
    default="default",
    show_default=True,
    help="Queue to consume (stream deferral:queue:<queue>).",
)
@click.option("--name", default=None, help="Consumer name (default: host-pid).")
@log_format_option
@metrics_port_option
@metrics_host_option
def consume(
    concurrency: int,
    queue: str,
    name: str | None,
    log_format: str,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run task attempts from the queue stream until SIGTERM."""
    from worker.service import WorkerService

    setup_logging(log_format)
    settings = settings_or_exit()
    smtp = loaded_or_exit(smtp_settings)
    try:
        check_id("queue", queue)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--queue") from None
    serve_metrics_or_exit("worker", metrics_port, metrics_host)
    service = WorkerService(
        settings,
        queue=queue,
        concurrency=concurrency,
        name=name or default_consumer_name(),
        smtp=smtp,
    )
    service.run(stop_on_signals())
