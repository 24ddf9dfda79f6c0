"""Storing the triggerer's lines about triggers in their tries' logs, a batch every
TASK_LOG_INTERVAL_SEC, with the runner of the triggers started since (in the same transaction);
kept for the next batch while PostgreSQL is unavailable (a log line never stops a trigger)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
from sqlalchemy import select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from broker.streams import CarriedLog
from deferral.runtime.faults import is_transient
from deferral.runtime.outages import OUTAGE
from deferral.store import tasklogs
from deferral.store.tables import TaskInstance
from deferral.store.tasklogs import NewLine
from triggerer.held import in_thread
from triggerer.tasklog import TaskLogHandler, TryKey, split_for_events

log = logging.getLogger("deferral.triggerer")

# How often the lines about triggers are stored in their tries' logs (a fired trigger's lines
# travel with its event instead, so that they precede the resumed attempt's lines).
TASK_LOG_INTERVAL_SEC = 1.0


class TaskLogStore:
    def __init__(self, sessions: sessionmaker[Session], name: str, max_bytes: int) -> None:
        self.sessions = sessions
        self.name = name
        self.max_bytes = max_bytes
        self.handler = TaskLogHandler()
        self.written = anyio.Lock()  # batches are stored one after the other, in order
        # Triggers started here whose trigger.triggerer_id is not written yet: written with the
        # next batch of task log lines, in its transaction.
        self.owned: list[int] = []

    async def run(self) -> None:
        while True:
            await anyio.sleep(TASK_LOG_INTERVAL_SEC)
            await self.store_all()

    async def store_all(self) -> None:
        async with self.written:
            owned, self.owned = self.owned, []
            await self.store(self.handler.take(), owned)

    async def store(self, lines: list[NewLine], owned: Sequence[int] = ()) -> None:
        """Store lines about triggers in their tries' logs (the caller holds
        ``written``: batches are stored in order), and record this triggerer as the
        runner of the ``owned`` triggers, in one transaction; both are kept for the next batch
        while Postgres is unavailable (a log line never stops a trigger)."""
        if not lines and not owned:
            return
        try:
            await in_thread(self._store_lines, lines, owned)
        except SQLAlchemyError as exc:
            if not is_transient(exc):
                log.exception(
                    "dropped %d task log line(s) and the runner of %d trigger(s), which could"
                    " not be stored",
                    len(lines),
                    len(owned),
                )
                return
            self.handler.put_back(lines)
            self.owned[:0] = owned
            OUTAGE.failed(exc, f"storing {len(lines)} task log line(s) (kept)")
        if self.handler.dropped:
            log.warning(
                "dropped %d task log line(s) while they could not be stored",
                self.handler.dropped,
            )
            self.handler.dropped = 0

    def _store_lines(self, lines: list[NewLine], owned: Sequence[int] = ()) -> None:
        with self.sessions.begin() as session:
            if owned:
                # Only for people looking (triggers list, the task's page); a trigger that
                # already fired is gone and writes nothing. Before the lines: their try rows'
                # locks are taken last (tasklogs.append).
                session.execute(
                    text(
                        "UPDATE trigger SET triggerer_id = :name"
                        " WHERE id = ANY(CAST(:ids AS bigint[]))"
                    ),
                    {"name": self.name, "ids": list(owned)},
                )
            unknown = {line.task_instance_id for line in lines if line.try_number == 0}
            if unknown:
                # Entries from before tokens named the try: the task instance's try now.
                tries = {
                    ti_id: try_number
                    for ti_id, try_number in session.execute(
                        select(TaskInstance.id, TaskInstance.try_number).where(
                            TaskInstance.id.in_(unknown)
                        )
                    )
                }
                lines = [
                    line._replace(try_number=tries.get(line.task_instance_id, 0))
                    if line.try_number == 0
                    else line
                    for line in lines
                ]
            tasklogs.append(session, lines, self.max_bytes)

    async def take_for_events(self, pending: set[TryKey]) -> dict[TryKey, CarriedLog]:
        """The queued lines of the ``pending`` tries' logs, to travel with their events (the
        scheduler stores them in the transaction that applies the event, so they come before
        the resumed attempt's lines); lines too long to travel are stored first, as all were
        before."""
        async with self.written:  # a batch being stored is stored first: lines in order
            split = split_for_events(self.handler.take(), pending)
            if split.rest:
                self.handler.put_back(split.rest)
            await self.store(split.store_first)
        return split.carried
