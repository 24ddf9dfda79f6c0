"""Helpers the ``deferral`` commands share: errors, sessions, the DAG bag, listings.

Two rules hold for every command, here and only here: a server that cannot be reached ends the
command with one line naming it (:class:`DeferralGroup`, exit 2), and every listing prints its
records as a table or as JSON alike (:func:`output_options`, :func:`emit`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import click
import psycopg
import redis.exceptions
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import redis_location
from deferral.config import ConfigError, Settings, load_settings
from deferral.controls import escape
from deferral.dag import DAG
from deferral.dagbag import DagBag, DagNotFound
from deferral.db import make_engine, make_sessionmaker, url_location
from deferral.faults import is_transient
from deferral.models import DagRun, TaskInstance
from deferral.timezone import make_aware

# Exit statuses every command shares (click itself exits 2 on a usage error).
EXIT_FAILED = 1
EXIT_UNAVAILABLE = 2
EXIT_TIMED_OUT = 3


def fail(message: str, code: int = EXIT_FAILED) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


# -- servers that cannot be reached ------------------------------------------------------------

# SQLSTATE undefined_table: the schema is missing (or older than this command).
_UNDEFINED_TABLE = "42P01"
_UNREACHABLE_REDIS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# Subclasses of ConnectionError in redis-py, yet the server answered: it is busy.
_BUSY_REDIS = (
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
)


class DeferralGroup(click.Group):
    """The ``deferral`` command group: whatever command runs, an unreachable (or transiently
    failing) PostgreSQL or Redis ends it with one line naming the server, exit 2, and a database
    without the schema with one line saying to run ``deferral db upgrade``; never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with terminal_safe_output():
                return super().invoke(ctx)
        except Exception as exc:
            said = server_error(exc, _settings_or_none())
            if said is None:
                raise
            line, code = said
            click.echo(f"error: {line}", err=True)
            ctx.exit(code)


def _settings_or_none() -> Settings | None:
    try:
        return load_settings()
    except ConfigError:
        return None


def server_error(exc: BaseException, settings: Settings | None) -> tuple[str, int] | None:
    """The one line (and exit status) for an error that says a server is unavailable, found in
    ``exc`` or the exceptions it was raised from; None for any other error."""
    cause: BaseException | None = exc
    while cause is not None:
        said = _server_error(cause, settings)
        if said is not None:
            return said
        cause = cause.__cause__
    return None


def _server_error(exc: BaseException, settings: Settings | None) -> tuple[str, int] | None:
    if isinstance(exc, redis.exceptions.RedisError) and is_transient(exc):
        where = "Redis" if settings is None else f"Redis at {_redis_place(settings.redis_url)}"
        if isinstance(exc, _UNREACHABLE_REDIS) and not isinstance(exc, _BUSY_REDIS):
            return f"cannot reach {where}: {_redis_reason(exc)}", EXIT_UNAVAILABLE
        return f"{where} is busy: {_first_line(exc)}; try again", EXIT_UNAVAILABLE
    if not isinstance(exc, DBAPIError):
        return None
    where = "PostgreSQL" if settings is None else f"PostgreSQL at {_db_place(settings)}"
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if is_transient(exc):
        reason = _postgres_reason(exc.orig)
        if sqlstate is None or sqlstate.startswith(("08", "57")) or exc.connection_invalidated:
            return f"cannot reach {where}: {reason}", EXIT_UNAVAILABLE
        return f"{where} is busy: {reason}; try again", EXIT_UNAVAILABLE
    if sqlstate == _UNDEFINED_TABLE:
        return (
            f"{where} lacks deferral's tables (or some of them): run `deferral db upgrade`",
            EXIT_FAILED,
        )
    return None


def _db_place(settings: Settings) -> str:
    try:
        return url_location(make_url(settings.database_url))
    except ArgumentError:
        return "?"


def _redis_place(url: str) -> str:
    try:
        return redis_location(url)
    except ValueError:
        return "?"


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


def _lower_first(text: str) -> str:
    """Lower-case a sentence's first letter ("Connection refused"), not an acronym's ("FATAL")."""
    return text[0].lower() + text[1:] if text[1:2].islower() else text


# What libpq puts before the reason; the place is said already.
_LIBPQ_PREFIXES = (
    re.compile(r"^connection (?:failed|is bad): "),
    re.compile(r"^connection to server (?:at|on) .*? failed: "),
    re.compile(r"^FATAL:\s+"),
)


def _postgres_reason(orig: BaseException | None) -> str:
    """libpq's reason, without the place it repeats: "connection refused"."""
    line = _first_line(orig)
    if isinstance(orig, psycopg.Error):
        for prefix in _LIBPQ_PREFIXES:
            line = prefix.sub("", line)
    return _lower_first(line.strip()) if line.strip() else type(orig).__name__


def _redis_reason(exc: BaseException) -> str:
    """The operating system's reason (connection refused, name or service not known) when the
    socket failed, else Redis's own message."""
    context = exc.__context__
    while context is not None:
        if isinstance(context, OSError) and context.strerror:
            return _lower_first(context.strerror)
        context = context.__context__
    return _first_line(exc)


# -- listings ----------------------------------------------------------------------------------

OUTPUT_FORMATS = ("table", "json")


# -- what is printed ----------------------------------------------------------------------------


class TerminalSafe:
    """A text stream that writes what it is given with control characters escaped (newline and
    tab kept): ids, log lines, XCom values and errors come from users, and an ESC sequence among
    them must not drive the terminal of whoever runs the command. A writer that draws with its
    own control sequences (``dags trigger --wait``'s live block) writes to ``unescaped``."""

    def __init__(self, stream: TextIO) -> None:
        self.unescaped = stream

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # as a text stream does: click then finds no binary writer
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.unescaped.write(escape(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.unescaped.flush()

    @property
    def closed(self) -> bool:
        return bool(getattr(self.unescaped, "closed", False))

    def isatty(self) -> bool:
        return self.unescaped.isatty()

    def fileno(self) -> int:
        return self.unescaped.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.unescaped, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:
        return getattr(self.unescaped, "errors", None)


def unescaped(stream: TextIO) -> TextIO:
    """The stream under a :class:`TerminalSafe` (for writers that escape what they write)."""
    return stream.unescaped if isinstance(stream, TerminalSafe) else stream


@contextlib.contextmanager
def terminal_safe_output() -> Iterator[None]:
    """Everything a command prints to stdout and stderr, escaped (see :class:`TerminalSafe`)."""
    saved = sys.stdout, sys.stderr
    sys.stdout = TerminalSafe(saved[0])
    sys.stderr = TerminalSafe(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``-o/--output table|json`` and ``--json`` (shorthand for ``--output json``) on a listing;
    the command receives the chosen format as ``output``."""

    @functools.wraps(func)
    def command(*args: Any, as_json: bool, output: str, **kwargs: Any) -> Any:
        return func(*args, output="json" if as_json else output, **kwargs)

    with_json = click.option(
        "--json", "as_json", is_flag=True, help="Print JSON (shorthand for --output json)."
    )(command)
    return click.option(
        "-o",
        "--output",
        type=click.Choice(OUTPUT_FORMATS),
        default="table",
        show_default=True,
        help="table: aligned columns; json: an array of objects, typed values.",
    )(with_json)


Record = Mapping[str, Any]


def emit(
    output: str,
    records: Sequence[Record],
    *,
    empty: str,
    cells: Mapping[str, Callable[[Any], str]] | None = None,
) -> None:
    """Print ``records`` (same keys, in column order) as JSON (an array of objects with typed
    values: numbers, booleans, null, ISO 8601 datetimes) or as a table under the upper-cased keys
    (``empty`` when there is none). ``cells`` formats a column's table cells its own way."""
    if output == "json":
        click.echo(json.dumps([dict(record) for record in records], indent=2, default=json_value))
        return
    if not records:
        click.echo(empty)
        return
    keys = list(records[0])
    formats = {key: (cells or {}).get(key, cell) for key in keys}
    rows = [[formats[key](record[key]) for key in keys] for record in records]
    echo_table([key.upper() for key in keys], rows)


def json_value(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def cell(value: Any) -> str:
    """How a table shows a value: "-" for none, datetimes to the second, lists comma-separated,
    mappings as key=value pairs, seconds to a tenth."""
    if value is None:
        return "-"
    if isinstance(value, dt.datetime):
        return when(value)
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, list | tuple):
        return ", ".join(str(item) for item in value) or "-"
    if isinstance(value, Mapping):
        return " ".join(f"{key}={item}" for key, item in value.items()) or "-"
    return str(value)


def echo_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``header`` in left-aligned columns two spaces apart."""
    widths = [max(len(row[col]) for row in (header, *rows)) for col in range(len(header))]
    for row in (header, *rows):
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


# -- settings, sessions, DAGs ------------------------------------------------------------------


def sessions(settings: Settings) -> sessionmaker[Session]:
    return make_sessionmaker(make_engine(settings.database_url))


def dagbag(settings: Settings) -> DagBag:
    try:
        return DagBag(settings.dags_folder).collect()
    except DagNotFound as exc:
        fail(str(exc))
        raise  # unreachable: fail exits


def load_dag(settings: Settings, dag_id: str) -> DAG:
    """The DAG from the DAGs folder; exits with one line naming it if there is none (and how
    many files fail to import: the DAG may be in one of them)."""
    bag = dagbag(settings)
    try:
        return bag.get_dag(dag_id)
    except DagNotFound as exc:
        broken = len(bag.import_errors)
        said = f"; {broken} file(s) fail to import (`deferral dags list` says why)"
        fail(f"{exc}{said if broken else ''}")
        raise  # unreachable: fail exits


class DateTimeParam(click.ParamType):
    """``2024-01-01`` or an ISO 8601 datetime; naive ones are read in DEFERRAL_DEFAULT_TIMEZONE,
    as the dates of DAG files are."""

    name = "date"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, dt.datetime):
            return value
        try:
            return make_aware(dt.datetime.fromisoformat(str(value)))
        except ValueError:
            self.fail(f"{value!r} is not a date (use YYYY-MM-DD or an ISO 8601 datetime)")


def find_run(session: Session, dag_id: str, run_id: str) -> DagRun | None:
    """The run ``run_id`` of DAG ``dag_id``, or None if there is none."""
    return session.scalars(
        select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
    ).one_or_none()


def task_instances(session: Session, dag_id: str, run_id: str, task_id: str) -> list[TaskInstance]:
    """The task instances of ``task_id`` in one run (a mapped task's map indexes in order)."""
    return list(
        session.scalars(
            select(TaskInstance)
            .where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
            )
            .order_by(TaskInstance.map_index)
        )
    )
