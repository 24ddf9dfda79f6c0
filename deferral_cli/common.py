"""Helpers the ``deferral`` commands share: errors, sessions, the DAG bag, listings.

Two rules hold for every command, each in one place: a server that cannot be reached ends the
command with one line naming it (:class:`deferral_cli.group.DeferralGroup`, exit 2), and every
listing prints its records as a table or as JSON alike (:func:`output_options`, :func:`emit`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from deferral.exceptions import ActionError
from deferral.runtime.config import Settings
from deferral.runtime.process import settings_or_exit
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.serialized_dags import StoredDag
from deferral.store.tables import Dag, DagRun
from deferral.timezone import make_aware

# What the read model gives every command (named again here, where the commands look for them).
from readmodel.dags import dag_to_change
from readmodel.errors import EXIT_FAILED as EXIT_FAILED
from readmodel.errors import EXIT_UNAVAILABLE as EXIT_UNAVAILABLE
from readmodel.errors import server_error as server_error
from readmodel.pages import DEFAULT_LIMIT, MAX_LIMIT, BadCursor, Page
from readmodel.records import Record as Record
from readmodel.records import find_run as find_run
from readmodel.records import json_value as json_value
from readmodel.records import task_instances as task_instances
from readmodel.records import when as when

if TYPE_CHECKING:
    # The DAG machinery is imported by the commands that load DAG files, when they do: the
    # listings read what a scheduler parsed (cli_start.py's `dags list`).
    from deferral.dag import DAG
    from deferral.loading.dagbag import DagBag

# Exit statuses every command shares (click itself exits 2 on a usage error).
EXIT_TIMED_OUT = 3
# As click exits on a usage error.
EXIT_USAGE = 2
# As a shell reports a command stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130


def stamp(at: dt.datetime, *, microseconds: bool = False) -> str:
    """A moment as the command shows it: this machine's local time, with the date and the zone,
    as its log lines read (their time is local too)."""
    local = at.astimezone()
    clock = local.strftime("%H:%M:%S.%f" if microseconds else "%H:%M:%S")
    return f"{local:%Y-%m-%d} {clock} {local:%Z}"


def run_conf(conf_json: str | None) -> dict[str, Any]:
    """A run's ``--conf`` JSON, or click's usage error saying what is wrong with it."""
    from deferral.store import actions  # with the DAG machinery, which `dags list` may not need

    try:
        return actions.parse_conf(conf_json)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--conf") from None


def fail(message: str, code: int = EXIT_FAILED) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


# -- listings ----------------------------------------------------------------------------------

OUTPUT_FORMATS = ("table", "json")


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


def limit_option(
    what: str, most: int | None = MAX_LIMIT
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--limit N``: how many ``what`` a listing's page shows (at most ``most``)."""
    return click.option(
        "--limit",
        type=click.IntRange(1, most),
        default=DEFAULT_LIMIT,
        show_default=True,
        help=f"Most {what} listed (a page: --after its cursor lists the next one).",
    )


after_option = click.option(
    "--after",
    metavar="CURSOR",
    default=None,
    help="List the page after the one whose cursor this is (printed under a page with more).",
)


@contextlib.contextmanager
def cursor_checked() -> Any:
    """A cursor no page gave ends the command as a usage error naming it."""
    try:
        yield
    except BadCursor as exc:
        raise click.BadParameter(str(exc), param_hint="'--after'") from None


def emit_page(output: str, page: Page, *, empty: str) -> None:
    """A page of a listing as :func:`emit` prints it; when more rows follow, one line on
    stderr saying how to list them (stdout stays the table or the JSON array)."""
    emit(output, page.rows, empty=empty)
    if page.after is not None:
        click.echo(f"more\u2026 (the next page: --after {page.after})", err=True)


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


# -- settings, sessions, DAGs ------------------------------------------------------------------


def sessions(settings: Settings) -> sessionmaker[Session]:
    return make_sessionmaker(make_engine(settings.database_url))


def _bag(settings: Settings) -> DagBag:
    """The DAGs folder read by this command, each file within DEFERRAL_DAGBAG_IMPORT_TIMEOUT
    (a file that never finishes is an import error, not a command that hangs)."""
    from deferral.loading.dagbag import DagBag

    return DagBag(settings.dags_folder, import_timeout=settings.dagbag_import_timeout)


def stored_dag(settings: Settings, dag_id: str) -> StoredDag:
    """The DAG's document a scheduler parsed (no DAG file is imported); exits with one line
    naming it if there is none."""
    try:
        with sessions(settings)() as session:
            return dag_to_change(session, dag_id, settings.dags_folder)
    except ActionError as exc:
        fail(str(exc))
        raise  # unreachable: fail exits


def load_dag(
    settings: Settings, dag_id: str, source: Path | None = None, bag: DagBag | None = None
) -> DAG:
    """The DAG from the DAGs folder (into ``bag``, by default one of this command's): only the
    file ``source`` when it is one (`dags test --subdir file.py`), else the file a scheduler
    last parsed it from, when one did (the rest of the folder is not imported), else the folder;
    exits with one line naming it if there is none, and the file it was last loaded from if that
    file now fails to import."""
    from deferral.loading.dagbag import DagNotFound

    fileloc = str(source.resolve()) if source is not None and source.is_file() else None
    if fileloc is None:
        # Unreachable, the database only takes the hint away: the folder is read instead.
        with contextlib.suppress(DBAPIError), sessions(settings)() as session:
            fileloc = session.scalar(select(Dag.fileloc).where(Dag.dag_id == dag_id))
    bag = bag or _bag(settings)
    try:
        if fileloc is not None:
            with contextlib.suppress(DagNotFound):
                return bag.get_dag(dag_id, fileloc)
        return bag.collect().get_dag(dag_id)
    except DagNotFound as exc:
        fail(not_found_message(str(exc), dag_id, fileloc, bag.import_errors))
        raise  # unreachable: fail exits


# How many of a folder's import errors a "DAG not found" line names.
SHOWN_IMPORT_ERRORS = 3


def not_found_message(
    message: str, dag_id: str, fileloc: str | None, import_errors: Mapping[str, str]
) -> str:
    """Why DAG ``dag_id`` is not in the DAGs folder: its file (``fileloc``, where a scheduler
    last loaded it) fails to import, or some files do and it may be in one of them."""
    if fileloc is not None and fileloc in import_errors:
        return f"DAG {dag_id!r} is in {fileloc}, which fails to import: {import_errors[fileloc]}"
    if import_errors:
        # Named here, not only counted: `dags test` may run on an embedded database no other
        # command reaches, so "see `dags list`" would be a dead end.
        count = len(import_errors)
        files = "1 DAG file fails" if count == 1 else f"{count} DAG files fail"
        shown = sorted(import_errors.items())[:SHOWN_IMPORT_ERRORS]
        why = "; ".join(f"{where}: {error}" for where, error in shown)
        more = "" if count <= SHOWN_IMPORT_ERRORS else "; `deferral dags list` shows the others"
        return f"{message}; {files} to import: {why}{more}"
    return message


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


LATEST = "latest"


def _run_id_or_latest(ctx: click.Context, param: click.Parameter, run_id: str) -> str:
    """``latest`` names the DAG's newest run (the first `runs list DAG` shows), unless a run is
    called that."""
    if run_id != LATEST:
        return run_id
    dag_id = ctx.params["dag_id"]
    with sessions(settings_or_exit())() as session:
        if find_run(session, dag_id, run_id) is not None:
            return run_id
        newest = session.scalar(
            select(DagRun.run_id)
            .where(DagRun.dag_id == dag_id)
            .order_by(DagRun.logical_date.desc(), DagRun.id.desc())
            .limit(1)
        )
    if newest is None:
        fail(f"DAG {dag_id!r} has no runs")
    return str(newest)


# The RUN_ID argument of the commands that name one run of DAG_ID (which comes first).
run_id_argument = click.argument("run_id", callback=_run_id_or_latest)
