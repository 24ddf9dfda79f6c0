"""The horizon pass: far timers (time triggers that deferred beyond the horizon and wait as
rows, see ``deferral.store.far_timers``) whose moment has come within the horizon are published
to their triggers stream, a bounded page at a time, earliest first.

The page is locked (``FOR UPDATE SKIP LOCKED``) while its entries are published and marked, and
the mark is committed only after the publish: replicas share the work without publishing a
trigger twice, and a crash between the publish and the commit publishes it again at the next
pass (a duplicate entry, which the triggerer replaces and the dedup key makes harmless), never
loses it."""

from __future__ import annotations

import datetime as dt
import logging

import msgspec
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import waiter_entry
from deferral.runtime.crypto import Cipher, DecryptionError
from deferral.store import far_timers

log = logging.getLogger("deferral.scheduler")

# Far timers published per transaction at most; a full page is followed by another at once.
PAGE = 1000
# Pages one pass publishes at most (the next pass, a second later, goes on).
PAGES_PER_PASS = 10


def publish_due(
    sessions: sessionmaker[Session],
    broker: Broker,
    cipher: Cipher,
    horizon: dt.timedelta,
    limit: int = PAGE,
) -> int:
    """Publish the entries of up to ``limit`` far timers whose moment is within ``horizon``;
    returns how many triggers were taken (published, or left to go with their last waiter)."""
    with sessions.begin() as session:
        due = far_timers.take_due(session, horizon, limit)
        if not due.trigger_ids:
            return 0
        entries = []
        for waiter in due.waiters:
            try:
                entries.append(waiter_entry(cipher, broker.keys, waiter))
            except (DecryptionError, msgspec.DecodeError):
                # Said once: it is marked published, and its timeout or a user ends the wait.
                log.error(
                    "cannot publish far timer %d: its kwargs no longer decrypt", waiter.trigger_id
                )
        if entries:
            broker.publish_many(entries)
        far_timers.mark_published(session, due.trigger_ids)
    log.info("published %d far timer(s) come within %s of their moment", len(entries), horizon)
    return len(due.trigger_ids)


def publish_all_due(
    sessions: sessionmaker[Session], broker: Broker, cipher: Cipher, horizon: dt.timedelta
) -> int:
    """:func:`publish_due` until a page is not full, at most ``PAGES_PER_PASS`` pages (each a
    transaction of its own): a backlog goes quickly without holding the loop for long."""
    total = 0
    for _ in range(PAGES_PER_PASS):
        taken = publish_due(sessions, broker, cipher, horizon)
        total += taken
        if taken < PAGE:
            break
    return total
