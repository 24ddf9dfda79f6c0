"""Transactional outbox: a stream entry that must follow a database change is written as an
``outbox`` row in the same transaction, published after commit, and marked published.

If the process dies between commit and XADD, :func:`relay` (run by the scheduler) publishes the
row later. Publishing twice is possible (died after XADD, before marking) and harmless: every
consumer applies its entries conditionally.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import Message, to_fields
from deferral.models import Outbox


def stage(session: Session, stream: str, message: Message) -> Outbox:
    """Add an outbox row to the caller's transaction; publish it with :func:`flush` after commit."""
    row = Outbox(stream=stream, fields=to_fields(message))
    session.add(row)
    return row


def flush(sessions: sessionmaker[Session], broker: Broker, rows: Sequence[Outbox]) -> None:
    """Publish committed outbox rows, then mark them published."""
    if not rows:
        return
    broker.publish_many([(row.stream, row.fields) for row in rows])
    with sessions.begin() as session:
        session.execute(
            update(Outbox)
            .where(Outbox.id.in_([row.id for row in rows]))
            .values(published_at=func.now())
        )


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
