"""Waits kept as rows: what resumes a deferred task that no triggerer runs."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from deferral.store.tables import SignalWait
from deferral.triggers.signal import CALLBACK_TRIGGER, SIGNAL_TRIGGER

RowWait = Literal["signal", "callback"]

_ROW_WAITS: dict[str, RowWait] = {SIGNAL_TRIGGER: "signal", CALLBACK_TRIGGER: "callback"}


def row_wait_of(classpath: str | None) -> RowWait | None:
    """ "signal" or "callback" for a trigger class whose waits a send resumes (no triggerer
    ever picks them up, so "not picked up yet" would be a false alarm); None for others."""
    return _ROW_WAITS.get(classpath or "")


def signal_key(session: Session, trigger_id: int | None) -> str | None:
    """The key a signal wait listens on (a callback's key is its token's: never shown)."""
    if trigger_id is None:
        return None
    return session.scalar(select(SignalWait.key).where(SignalWait.trigger_id == trigger_id))


def how_to_resume(wait: RowWait, key: str | None) -> str:
    """One line telling a reader what resumes the task."""
    if wait == "callback":
        return "a POST of its answer to its callback URL (POST /api/v1/callbacks/<token>)"
    return f"a signal sent to key {key!r} (`deferral signals send {key} --payload JSON`)"
