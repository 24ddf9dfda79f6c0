"""Helpers the ``deferral`` commands share: errors, sessions, the DAG bag, tables."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Sequence

import click
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.config import Settings
from deferral.dagbag import DagBag, DagNotFound
from deferral.db import make_engine, make_sessionmaker
from deferral.models import DagRun


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def sessions(settings: Settings) -> sessionmaker[Session]:
    return make_sessionmaker(make_engine(settings.database_url))


def dagbag(settings: Settings) -> DagBag:
    try:
        return DagBag(settings.dags_folder).collect()
    except DagNotFound as exc:
        fail(str(exc))
        raise  # unreachable: fail exits


def find_run(session: Session, dag_id: str, run_id: str) -> DagRun | None:
    """The run ``run_id`` of DAG ``dag_id``, or None if there is none."""
    return session.scalars(
        select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
    ).one_or_none()


def echo_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``header`` in left-aligned columns two spaces apart."""
    widths = [max(len(row[col]) for row in (header, *rows)) for col in range(len(header))]
    for row in (header, *rows):
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")
