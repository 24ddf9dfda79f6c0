"""Waiting for a signal: a task resumes with the payload of a signal sent to a key."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

from deferral.authoring.current import get_current_context
from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of

MAX_KEY_LENGTH = 200
# Signals are kept this long (then pruned), so no lookback can reach further.
SIGNAL_RETENTION = dt.timedelta(days=7)
_KEY_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:@")


class SignalError(ValueError):
    """A signal key, lookback or payload is not acceptable; the message names it."""


def check_signal_key(key: object) -> str:
    """``key`` if it is 1 to MAX_KEY_LENGTH letters, digits or ``_-.:@`` (it goes in a URL path
    and in log lines as it is); else SignalError naming it."""
    if not isinstance(key, str) or not key:
        raise SignalError(f"signal key {key!r} is invalid: use a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise SignalError(
            f"signal key {key[:40]!r}... is {len(key)} characters long, more than {MAX_KEY_LENGTH}"
        )
    if not _KEY_CHARACTERS.issuperset(key):
        raise SignalError(
            f"signal key {key[:60]!r} is invalid: use letters, digits, '_', '-', '.', ':' or '@'"
        )
    return key


def check_lookback(lookback: object) -> dt.timedelta:
    if not isinstance(lookback, dt.timedelta):
        raise SignalError(f"lookback must be a timedelta, got {type(lookback).__name__}")
    if not dt.timedelta(0) <= lookback <= SIGNAL_RETENTION:
        raise SignalError(
            f"lookback {lookback} is out of range: from 0 to {SIGNAL_RETENTION} (signals are kept"
            " that long)"
        )
    return lookback


class _RowTrigger(BaseTrigger):
    """A wait kept as a row and resumed by a send: nothing of it runs in a triggerer."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # Reached only if such a wait was published to a triggerer (a subclass, or arguments
        # the worker refused): failing says so rather than waiting for ever.
        raise SignalError(
            f"{type(self).__name__} waits are resumed by signals and callbacks, not run in a"
            " triggerer (a subclass, or a callback token of another task or try?)"
        )
        yield TriggerEvent(None)  # pragma: no cover - makes this an async generator


class SignalTrigger(_RowTrigger):
    """Resumes the task with the payload of the next signal sent to ``key``, or of the latest
    one sent within ``lookback`` before the task started waiting.

    Nothing runs for it in a triggerer: the worker that records the deferral records the wait
    as a row, and ``deferral.signals.send`` resumes the tasks waiting on the key."""

    def __init__(self, key: str, lookback: dt.timedelta = dt.timedelta(0)) -> None:
        super().__init__()
        self.key = check_signal_key(key)
        self.lookback = check_lookback(lookback)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(SignalTrigger), {"key": self.key, "lookback": self.lookback}


class CallbackTrigger(_RowTrigger):
    """Resumes the task when its callback token (``context["callback"].token``, or ``token``)
    is posted to ``POST /api/v1/callbacks/{token}``: with ``event`` the posted payload on
    ``"success"``, failing it (or retrying) with the payload's message on ``"failure"``."""

    def __init__(self, token: str | None = None) -> None:
        super().__init__()
        if token is None:
            token = get_current_context()["callback"].token
        if not isinstance(token, str):
            raise SignalError(f"callback token must be a string, got {type(token).__name__}")
        self.token = token

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(CallbackTrigger), {"token": self.token}


SIGNAL_TRIGGER = classpath_of(SignalTrigger)
CALLBACK_TRIGGER = classpath_of(CallbackTrigger)
