"""What every service process shares: logging, stop signals, names, command-line helpers."""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import gc
import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, TypeVar

import click

from deferral.runtime.config import ConfigError, Settings, load_settings
from deferral.runtime.controls import escape

# The attribute of a log record that holds the ids of the task instance, try and trigger it is
# about (set with ``extra=log_ids(...)``); the JSON format writes them as fields of their own.
LOG_IDS_ATTR = "deferral_ids"
# What log_ids returns: the ``extra=`` of a logging call.
LogExtra = dict[str, dict[str, Any]]

T = TypeVar("T")


def log_ids(
    *,
    task: str | None = None,
    task_instance_id: int | None = None,
    try_number: int | None = None,
    trigger_id: int | None = None,
) -> LogExtra:
    """``extra=`` for a log call about a task instance or a trigger: ``task`` is its label
    (dag.run.task[map]); only the ids given become fields."""
    given = {
        "task": task,
        "task_instance_id": task_instance_id,
        "try_number": try_number,
        "trigger_id": trigger_id,
    }
    return {LOG_IDS_ATTR: {key: value for key, value in given.items() if value is not None}}


def utc_timestamp(created: float) -> str:
    """A log record's time in ISO 8601, UTC, to the millisecond: 2024-05-01T12:00:00.123Z."""
    moment = dt.datetime.fromtimestamp(created, dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, logger, message, the ids the record is about,
    and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": utc_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, LOG_IDS_ATTR, {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


# Lines after a record's first (a traceback, text with a newline in it) start with this: no text a
# record carries can pass for a record of its own.
CONTINUATION = "\n    "


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message>``, control characters escaped and every line after the
    first indented: a run id holding a newline or an ESC sequence (from a user, a DAG file, a
    stream entry) can neither forge a log line nor drive the terminal of whoever reads the log."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record)).replace("\n", CONTINUATION)


def setup_logging(log_format: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class Every:
    """Runs a step at most once per interval, each wait drawn between 80 and 100 % of it.

    The spread keeps housekeeping off the moments work arrives: a step run when a deferral woke
    the loop would otherwise be due again exactly when a trigger of whole seconds fires, and
    hold up its event (as it did in idle_runs' resumes: benchmarks/README.md)."""

    def __init__(self, interval: float, step: Callable[[], object]) -> None:
        self.interval, self.step, self.due = interval, step, 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now >= self.due:
            self.due = now + self.interval * random.uniform(0.8, 1.0)
            self.step()

    def due_in(self) -> float:
        """Seconds until the step is due (0 if it is)."""
        return max(0.0, self.due - time.monotonic())


def wait_ms_until_due(periodic: Sequence[Every], longest_ms: int) -> int:
    """How long a loop may block for work before its next housekeeping step falls due: at least
    1 ms (a block of 0 would mean for ever to Redis), at most ``longest_ms``."""
    due_ms = min((step.due_in() for step in periodic), default=longest_ms / 1000) * 1000
    return max(1, min(longest_ms, round(due_ms)))


def freeze_startup_objects() -> None:
    """Put what start-up created (modules, DAGs, engines) out of the garbage collector's reach:
    every full collection otherwise walks all of it again (a fifth of a scheduler's time applying
    a batch of 2,000 events). Called once a process is ready for its loop."""
    gc.collect()
    gc.freeze()


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def stop_on_signals(process: str) -> threading.Event:
    """An event set by SIGTERM or SIGINT, for loops that finish their step and stop; the log
    line names ``process`` (e.g. ``worker host-42``), since several share one terminal."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        logging.getLogger("deferral").info("%s: received %s, stopping", process, name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def settings_or_exit() -> Settings:
    """Load settings; a bad one stops the process with one line naming it (exit 2)."""
    return loaded_or_exit(load_settings)


def loaded_or_exit(load: Callable[[], T]) -> T:
    """``load()``, or, if it raises ConfigError, stop the process with its one line (exit 2)."""
    try:
        return load()
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def log_format_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="Log line format on stderr.",
    )(func)


def metrics_port_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--metrics-port",
        type=click.IntRange(1, 65535),
        envvar="DEFERRAL_METRICS_PORT",
        default=None,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics"
        " (default: DEFERRAL_METRICS_PORT; none).",
    )(func)


# Metrics name every trigger class, queue and pool: only this host sees them unless told.
DEFAULT_METRICS_HOST = "127.0.0.1"


def queues_value(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, ...] | None:
    """Click callback of ``--queues a,b``: the queue names, or a usage error naming the fault."""
    from deferral.store.queues import parse_queues  # the models, only once the option is given

    if value is None:
        return None
    try:
        return parse_queues(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def metrics_host_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--metrics-host",
        envvar="DEFERRAL_METRICS_HOST",
        default=DEFAULT_METRICS_HOST,
        show_default=True,
        help="The address the metrics server binds (0.0.0.0: every interface).",
    )(func)


def serve_metrics_or_exit(service: str, port: int | None, host: str = DEFAULT_METRICS_HOST) -> None:
    """Serve ``service``'s metrics on ``host``:``port`` (if a port is given); an address that
    cannot be bound stops the process with one line (exit 2)."""
    if port is None:
        return
    from deferral.runtime import metrics

    try:
        metrics.serve(service, port, host)
    except metrics.MetricsServerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


# Every command group of every program: -h as well as --help (inherited by its subcommands).
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


def command_group(
    name: str | None = None, **attrs: Any
) -> Callable[[Callable[..., Any]], click.Group]:
    """``click.group`` with ``-h`` for ``--help`` and ``--version`` (the installed package's
    version), as every command group of deferral's programs has."""

    def decorate(func: Callable[..., Any]) -> click.Group:
        with_version = click.version_option(
            package_name="deferral", message="%(prog)s %(version)s"
        )(func)
        return click.group(name, context_settings=CONTEXT_SETTINGS, **attrs)(with_version)

    return decorate


@contextlib.contextmanager
def raising_after(seconds: float, error: Callable[[], BaseException]) -> Iterator[None]:
    """Raise ``error()`` in the code the block runs once ``seconds`` have passed (a SIGALRM, so
    the main thread's only). An alarm set outside (a task's execution_timeout around a DAG
    load) is set again on the way out, for what was left of it, with its handler."""

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise error()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    began = time.monotonic()
    outer_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:
            left = outer_left - (time.monotonic() - began)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6))
