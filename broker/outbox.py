"""Transactional outbox: a stream entry that must follow a database change is written as an
``outbox`` row in the same transaction, published after commit, and marked published.

If the process dies between commit and XADD, :func:`relay` (run by the scheduler) publishes the
row later. Publishing twice is possible (died after XADD, before marking) and harmless: every
consumer applies its entries conditionally.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import Message, to_fields
from deferral.models import Outbox


@dataclass(frozen=True)
class Staged:
    """An outbox row written in the caller's transaction, to publish after commit."""

    id: int
    stream: str
    fields: dict[str, str]


# Ids drawn first (in the order given) so that each row's id is known without relying on the
# order of RETURNING; one statement whatever the batch size.
_STAGE_SQL = text(
    """
    WITH staged AS MATERIALIZED (
        SELECT nextval(pg_get_serial_sequence('outbox', 'id')) AS id, stream, fields, n
        FROM unnest(CAST(:streams AS text[]), CAST(:fields AS jsonb[])) WITH ORDINALITY
            AS r (stream, fields, n)
    ), inserted AS (
        INSERT INTO outbox (id, stream, fields) SELECT id, stream, fields FROM staged
    )
    SELECT id FROM staged ORDER BY n
    """
)

_PUBLISHED_SQL = text(
    "UPDATE outbox SET published_at = now() WHERE id = ANY(CAST(:ids AS bigint[]))"
)


def stage_many(session: Session, items: Sequence[tuple[str, Message]]) -> list[Staged]:
    """Write outbox rows in the caller's transaction, in one statement (plain SQL: on every
    deferral's and every dispatch's path); publish them with :func:`flush` after commit."""
    if not items:
        return []
    fields = [(stream, to_fields(message)) for stream, message in items]
    ids = session.scalars(
        _STAGE_SQL,
        {
            "streams": [stream for stream, _ in fields],
            "fields": [json.dumps(values) for _, values in fields],
        },
    ).all()
    return [Staged(i, *row) for i, row in zip(ids, fields, strict=True)]


def stage(session: Session, stream: str, message: Message) -> Staged:
    """:func:`stage_many` for one row."""
    return stage_many(session, [(stream, message)])[0]


def flush(sessions: sessionmaker[Session], broker: Broker, rows: Sequence[Staged | Outbox]) -> None:
    """Publish committed outbox rows, then mark them published."""
    if not rows:
        return
    broker.publish_many([(row.stream, row.fields) for row in rows])
    with sessions.begin() as session:
        session.execute(_PUBLISHED_SQL, {"ids": [row.id for row in rows]})


def relay(
    sessions: sessionmaker[Session], broker: Broker, older_than: dt.timedelta, limit: int = 1000
) -> int:
    """Publish rows left unpublished for longer than ``older_than``; return how many."""
    with sessions.begin() as session:
        rows = list(
            session.scalars(
                select(Outbox)
                .where(
                    Outbox.published_at.is_(None),
                    Outbox.created_at < func.now() - older_than,
                )
                .order_by(Outbox.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
        )
        if rows:
            broker.publish_many([(row.stream, row.fields) for row in rows])
            for row in rows:
                row.published_at = func.now()
    return len(rows)
