"""Transactional outbox: a stream entry that must follow a database change is written as an
``outbox`` row in the same transaction, published after commit, and marked published. The
entries a transaction stages for one stream share one row (``fields`` the first, ``more_fields``
the others, in order): a batch of deferrals or dispatches writes a row per stream, not per entry.

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
from deferral.store.db import one_statement
from deferral.store.tables import Outbox


@dataclass(frozen=True)
class Staged:
    """An entry of an outbox row written in the caller's transaction, to publish after commit
    (the entries of one row share its id)."""

    id: int
    stream: str
    fields: dict[str, str]


# Ids drawn first (in the order given) so that each row's id is known without relying on the
# order of RETURNING; one statement whatever the batch size.
_STAGE_SQL = text(
    """
    WITH staged AS MATERIALIZED (
        SELECT nextval(pg_get_serial_sequence('outbox', 'id')) AS id, stream, fields,
               more_fields, n
        FROM unnest(CAST(:streams AS text[]), CAST(:fields AS jsonb[]),
                    CAST(:more_fields AS jsonb[])) WITH ORDINALITY
            AS r (stream, fields, more_fields, n)
    ), inserted AS (
        INSERT INTO outbox (id, stream, fields, more_fields)
        SELECT id, stream, fields, more_fields FROM staged
    )
    SELECT id FROM staged ORDER BY n
    """
)

# Committed on its own without waiting for its WAL to reach the disk (synchronous_commit off
# for this transaction only): a mark lost with a crash of PostgreSQL only makes the relay
# publish the row again, which consumers take as a duplicate; the next commit of any
# transaction flushes it anyway. It was a full commit after every dispatch and every batch of
# deferrals, waited for while the queued tasks' workers started them.
_PUBLISHED_SQL = text(
    """
    WITH unflushed AS (SELECT set_config('synchronous_commit', 'off', true))
    UPDATE outbox SET published_at = now()
    FROM unflushed
    WHERE id = ANY(CAST(:ids AS bigint[]))
    """
)


def stage_many(session: Session, items: Sequence[tuple[str, Message]]) -> list[Staged]:
    """Write the entries in the caller's transaction, one outbox row per stream, in one
    statement (plain SQL: on every deferral's and every dispatch's path); publish them with
    :func:`flush` after commit. Returns the entries, in the order given."""
    if not items:
        return []
    by_stream: dict[str, list[dict[str, str]]] = {}
    for stream, message in items:
        by_stream.setdefault(stream, []).append(to_fields(message))
    ids = session.scalars(
        _STAGE_SQL,
        {
            "streams": list(by_stream),
            "fields": [json.dumps(entries[0]) for entries in by_stream.values()],
            "more_fields": [
                json.dumps(entries[1:]) if len(entries) > 1 else None
                for entries in by_stream.values()
            ],
        },
    ).all()
    row_of = dict(zip(by_stream, ids, strict=True))
    return [Staged(row_of[stream], stream, to_fields(message)) for stream, message in items]


def stage(session: Session, stream: str, message: Message) -> Staged:
    """:func:`stage_many` for one row."""
    return stage_many(session, [(stream, message)])[0]


def entries_of(row: Outbox) -> list[tuple[str, dict[str, str]]]:
    """The stream entries an outbox row holds, in the order they are published."""
    return [(row.stream, fields) for fields in (row.fields, *(row.more_fields or ()))]


def flush(sessions: sessionmaker[Session], broker: Broker, entries: Sequence[Staged]) -> None:
    """Publish committed outbox entries, then mark their rows published."""
    if not entries:
        return
    broker.publish_many([(entry.stream, entry.fields) for entry in entries])
    with one_statement(sessions) as session:
        session.execute(_PUBLISHED_SQL, {"ids": sorted({entry.id for entry in entries})})


def relay(
    sessions: sessionmaker[Session], broker: Broker, older_than: dt.timedelta, limit: int = 1000
) -> int:
    """Publish rows left unpublished for longer than ``older_than`` (each with all its
    entries); return how many rows."""
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
            broker.publish_many([entry for row in rows for entry in entries_of(row)])
            for row in rows:
                row.published_at = func.now()
    return len(rows)
