"""Rebuilding the streams from Postgres after Redis lost its data.

Postgres is the truth: every deferred task's trigger and every queued task's attempt can be
published again from its rows. Consumers tolerate duplicates (a queue message starts an attempt
only while the task is queued at that try; a trigger entry for a trigger already running is
dropped; events are dedup-keyed), so rebuilding over streams that still hold some entries is safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.streams import StreamKeys, queue_message, task_label, trigger_message
from deferral.crypto import Cipher, DecryptionError
from deferral.models import TaskInstance, Trigger
from deferral.states import TaskState

TI = TaskInstance


@dataclass(frozen=True)
class Rebuilt:
    entries: list[tuple[str, dict[str, str]]]
    triggers: int
    queued: int
    unreadable: list[int]  # trigger ids whose kwargs no key of ours decrypts


def rebuild(session: Session, keys: StreamKeys, cipher: Cipher) -> Rebuilt:
    """Every stream entry Postgres says should exist, as (stream, fields) pairs."""
    entries: list[tuple[str, dict[str, str]]] = []
    deferred = session.execute(
        select(TI, Trigger)
        .join(Trigger, Trigger.id == TI.trigger_id)
        .where(TI.state == TaskState.DEFERRED)
    ).all()
    unreadable: list[int] = []
    for ti, trigger in deferred:
        try:
            kwargs = msgspec.json.decode(cipher.decrypt(trigger.kwargs))
        except (DecryptionError, msgspec.DecodeError):
            unreadable.append(trigger.id)
            continue
        message = trigger_message(
            cipher,
            trigger_id=trigger.id,
            classpath=trigger.classpath,
            kwargs=kwargs,
            task_instance_id=ti.id,
            task=task_label(ti.dag_id, ti.run_id, ti.task_id, ti.map_index),
        )
        entries.append((keys.triggers, msgspec.structs.asdict(message)))
    queued = session.scalars(select(TI).where(TI.state == TaskState.QUEUED).order_by(TI.id)).all()
    for ti in queued:
        message_q = queue_message(
            ti.id, ti.try_number, ti.dag_id, ti.run_id, ti.task_id, ti.map_index
        )
        entries.append((keys.queue(ti.queue), msgspec.structs.asdict(message_q)))
    triggers = len(deferred) - len(unreadable)
    return Rebuilt(entries, triggers=triggers, queued=len(queued), unreadable=unreadable)
