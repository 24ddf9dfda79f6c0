"""What every service process shares: logging, stop signals, names, command-line helpers."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import click

from deferral.config import ConfigError, Settings, load_settings


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "at": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(log_format: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class Every:
    """Runs a step at most once per interval."""

    def __init__(self, interval: float, step: Callable[[], object]) -> None:
        self.interval, self.step, self.last = interval, step, 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.step()


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


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT, for loops that finish their step and stop."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        logging.getLogger("deferral").info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def settings_or_exit() -> Settings:
    """Load settings; a bad one stops the process with one line naming it (exit 2)."""
    try:
        return load_settings()
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
