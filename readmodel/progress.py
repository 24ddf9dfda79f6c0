"""The progress a task's trigger reported (``TriggerProgress``), as the task page and ``deferral
tasks explain`` show it: the reports kept for its current try, payloads masked and cut."""

from __future__ import annotations

from sqlalchemy.orm import Session

from deferral.runtime import serialization
from deferral.runtime.crypto import Cipher
from deferral.runtime.secrets_masker import redact
from deferral.store import progress
from deferral.store.tables import TaskInstance
from readmodel.records import Record, when

# How much of one payload a page or a line shows.
PAYLOAD_SHOWN = 200


def _shown(payload: object) -> str:
    text: str = redact(serialization.shown(serialization.dumps(payload, "progress")))
    return text if len(text) <= PAYLOAD_SHOWN else text[: PAYLOAD_SHOWN - 1] + "\u2026"


def progress_of(session: Session, cipher: Cipher, ti: TaskInstance) -> Record | None:
    """The current try's progress: reports kept (oldest first), how many in all and dropped;
    None when its trigger reported none."""
    if ti.try_number < 1:
        return None
    found = progress.of_try(session, cipher, ti.id, ti.try_number)
    if not found.kept:
        return None
    return {
        "total": found.total,
        "dropped": found.dropped,
        "kept_at_most": progress.KEPT,
        "reports": [{"seq": r.seq, "at": r.at, "payload": _shown(r.payload)} for r in found.kept],
    }


def progress_lines(shown: Record | None) -> list[str]:
    """``deferral tasks explain``'s lines for :func:`progress_of`."""
    if shown is None:
        return []
    dropped = shown["dropped"]
    said = f", the first {dropped} dropped (the last {shown['kept_at_most']} are kept)"
    lines = [f"  progress reported by its trigger: {shown['total']}{said if dropped else ''}"]
    lines += [f"    #{r['seq']} at {when(r['at'])}: {r['payload']}" for r in shown["reports"]]
    return lines
