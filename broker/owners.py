"""The consumers' rows in PostgreSQL (:class:`broker.deliveries.OwnerRegistry`): each service
passes its own table (worker, triggerer, scheduler), whose rows its processes heartbeat."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.deliveries import OwnerRecord
from deferral.store import liveness

# Names looked up per query: a group's consumers, or the owners of one page of pending entries.
LOOKUP_BATCH = 1_000


class PostgresOwners:
    def __init__(self, sessions: sessionmaker[Session], model: liveness.Process) -> None:
        self.sessions = sessions
        self.model = model

    def owners(self, names: Collection[str]) -> Mapping[str, OwnerRecord]:
        model = self.model
        wanted = sorted(set(names))
        found: dict[str, OwnerRecord] = {}
        with self.sessions() as session:
            for start in range(0, len(wanted), LOOKUP_BATCH):
                rows = session.execute(
                    select(
                        model.name,
                        model.state,
                        func.extract("epoch", func.now() - model.latest_heartbeat),
                    ).where(model.name.in_(wanted[start : start + LOOKUP_BATCH]))
                )
                for name, state, age in rows:
                    running = state == liveness.RUNNING
                    found[name] = OwnerRecord(running, max(0.0, float(age)))
        return found
