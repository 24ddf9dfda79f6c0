"""``worker consume``."""

from __future__ import annotations

import click

from deferral.runtime.config import smtp_settings
from deferral.runtime.process import (
    command_group,
    default_consumer_name,
    loaded_or_exit,
    log_format_option,
    metrics_host_option,
    metrics_port_option,
    queues_value,
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
    "--queues",
    "--queue",
    "queues",
    default="default",
    show_default=True,
    callback=queues_value,
    help="Comma-separated queues to consume (stream deferral:queue:<queue> each); --queue is"
    " the same option.",
)
@click.option("--name", default=None, help="Consumer name (default: host-pid).")
@log_format_option
@metrics_port_option
@metrics_host_option
def consume(
    concurrency: int,
    queues: tuple[str, ...],
    name: str | None,
    log_format: str,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run task attempts from the queue streams until SIGTERM."""
    from worker.service import WorkerService

    setup_logging(log_format)
    settings = settings_or_exit()
    smtp = loaded_or_exit(smtp_settings)
    # Made first: its task processes' fork server is forked from this process before it has a
    # thread (the metrics server's) or a signal handler (worker/DECISIONS.md rule 1).
    service = WorkerService(
        settings,
        queues=queues,
        concurrency=concurrency,
        name=name or default_consumer_name(),
        smtp=smtp,
    )
    serve_metrics_or_exit("worker", metrics_port, metrics_host)
    service.run(stop_on_signals(f"worker {service.name}"))
