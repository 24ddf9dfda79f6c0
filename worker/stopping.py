"""A worker stopped by SIGTERM: it takes no more work, lets its running attempts finish for up to
``DEFERRAL_WORKER_STOP_GRACE_SEC``, then hands the rest back untried (worker/DECISIONS.md)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from broker.consumers import ConsumerSet
from deferral.runtime.config import Settings
from deferral.store import transitions
from worker.children import ChildPool
from worker.recording import Running, write_lines

log = logging.getLogger("deferral.worker")


def hand_back(
    running: Sequence[Running],
    *,
    name: str,
    pool: ChildPool[int],
    sessions: sessionmaker[Session],
    consumer: ConsumerSet,
    settings: Settings,
) -> None:
    """Kill the processes of attempts still ``running`` when the stop grace ran out, move them
    back to scheduled at their try (the scheduler queues them again; no try is counted) and
    retire their entries. Safe to repeat after a failure: a kill of a killed process and a move
    already made do nothing."""
    for item in running:
        pool.kill(item.attempt.task_instance_id)
    reason = (
        f"worker {name} stopped and its stop grace ({settings.worker_stop_grace_sec:g} s) ran"
        " out: killed its process and handed it back to run again at the same try"
    )
    with sessions.begin() as session:
        moved = set(transitions.hand_back(session, [r.attempt for r in running], reason))
        said = [r.log_line(reason) for r in running if r.attempt.task_instance_id in moved]
        write_lines(session, said, settings)
    consumer.retire([r.delivery.entry for r in running])
    for item in running:
        log.warning(
            "%s try %d: %s",
            item.label,
            item.attempt.try_number,
            "handed back" if item.attempt.task_instance_id in moved else "already ended elsewhere",
            extra=item.log_ids(),
        )
