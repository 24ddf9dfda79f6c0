"""Keyset pages: a list is read a page at a time, in an order an index gives, from just after the
last row of the previous page (its cursor), never with an OFFSET or a count of everything. A page
reads one row more than it shows: if that row exists, there is a next page."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from readmodel.records import Record

Row = TypeVar("Row")

# Rows a page shows unless told otherwise, and at most.
DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000


class BadCursor(ValueError):
    """A cursor that no page of this list gave; the message names it."""


@dataclass(frozen=True)
class Page:
    """Rows of one page, and the cursor of the next (None: this is the last page)."""

    rows: list[Record]
    after: str | None

    @property
    def more(self) -> bool:
        return self.after is not None


def page_of(
    found: Sequence[Row],
    limit: int,
    record: Callable[[Row], Record],
    cursor: Callable[[Row], tuple[Any, ...]],
) -> Page:
    """The page of ``found`` (read with ``limit + 1``): its first ``limit`` rows as records, and
    the cursor of the last one shown if a row is left over."""
    shown = list(found[:limit])
    more = len(found) > limit and bool(shown)
    return Page([record(row) for row in shown], encode(cursor(shown[-1])) if more else None)


def encode(key: tuple[Any, ...]) -> str:
    """A cursor: the sort key of a page's last row, its parts joined by commas."""
    return ",".join(
        part.isoformat() if isinstance(part, dt.datetime) else str(part) for part in key
    )


def decode(cursor: str, *kinds: type) -> tuple[Any, ...]:
    """The sort key in ``cursor``, each part of the kind given (int or datetime)."""
    parts = cursor.split(",")
    try:
        if len(parts) != len(kinds):
            raise ValueError
        return tuple(
            dt.datetime.fromisoformat(part) if kind is dt.datetime else int(part)
            for part, kind in zip(parts, kinds, strict=True)
        )
    except ValueError:
        raise BadCursor(f"{cursor[:60]!r} is not a cursor of this list") from None
