"""Waiting for a signal: a task resumes with the payload of a signal sent to a key."""

from __future__ import annotations

import datetime as dt
import json
import math
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


# The operators a ``where`` filter may use on a field, and their jsonpath spelling.
_COMPARISONS = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
_IN = "in"


def _literal(value: object, where: str) -> str:
    """``value`` as a jsonpath literal: a string, a number, a boolean or null."""
    if value is None or isinstance(value, bool | str):
        return json.dumps(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return json.dumps(value)
    raise SignalError(
        f"where: {where} compares with {type(value).__name__} {value!r:.40}; use a string, a"
        " number, a boolean or None"
    )


def _path(field: object) -> str:
    """A field's dotted path (``"customer.tier"``) as a jsonpath accessor."""
    if not isinstance(field, str) or not field or any(not part for part in field.split(".")):
        raise SignalError(f"where: field {field!r:.60} is invalid: use a name or a dotted path")
    return "$" + "".join(f".{json.dumps(part)}" for part in field.split("."))


def _condition(field: str, test: object) -> str:
    path = _path(field)
    if not isinstance(test, dict):
        return f"{path} == {_literal(test, repr(field))}"
    if not test:
        raise SignalError(f"where: field {field!r:.60} has an empty condition")
    parts = []
    for op, operand in test.items():
        if op == _IN:
            if not isinstance(operand, list | tuple | set | frozenset) or not operand:
                raise SignalError(f"where: 'in' of {field!r:.60} needs a non-empty list")
            choices = " || ".join(f"@ == {_literal(v, repr(field))}" for v in operand)
            parts.append(f"exists({path} ? ({choices}))")
        elif op in _COMPARISONS:
            if op not in ("==", "!=") and (
                isinstance(operand, bool) or not isinstance(operand, int | float | str)
            ):
                raise SignalError(
                    f"where: {op!r} of {field!r:.60} needs a number or a string, got"
                    f" {operand!r:.40}"
                )
            parts.append(f"{path} {_COMPARISONS[op]} {_literal(operand, repr(field))}")
        else:
            known = ", ".join(repr(o) for o in [*_COMPARISONS, _IN])
            raise SignalError(f"where: unknown operator {op!r:.40} for {field!r:.60} (use {known})")
    return " && ".join(f"({part})" for part in parts)


def where_predicate(where: object) -> str | None:
    """A ``where`` filter as the jsonpath predicate PostgreSQL evaluates against a signal's
    payload (``payload @@ predicate``): every field's condition holds. A field is a name or a
    dotted path into nested objects; its condition a value (equality), or a dict of operators
    (``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``). None for no filter; SignalError naming
    what is at fault otherwise."""
    if where is None:
        return None
    if not isinstance(where, dict) or not where:
        raise SignalError(
            f"where must be a non-empty dict of field -> condition, got {where!r:.60}"
        )
    return " && ".join(f"({_condition(field, test)})" for field, test in where.items())


# The states a cancel-on may end its task in.
CANCEL_STATES = ("skipped", "failed")


def check_cancel_on(cancel_on: object, cancel_state: object) -> None:
    """A deferral's ``cancel_on`` (None, or a SignalTrigger itself) and ``cancel_state``
    (skipped or failed); TypeError / ValueError naming the fault."""
    if cancel_on is not None and type(cancel_on) is not SignalTrigger:
        raise TypeError(f"cancel_on must be a SignalTrigger, got {type(cancel_on).__name__}")
    if cancel_state not in CANCEL_STATES:
        raise ValueError(f"cancel_state must be 'skipped' or 'failed', got {cancel_state!r:.40}")


class RowTrigger(BaseTrigger):
    """A wait kept as a row and resumed by a send: nothing of it runs in a triggerer."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # Reached only if such a wait was published to a triggerer (a subclass, or arguments
        # the worker refused): failing says so rather than waiting for ever.
        raise SignalError(
            f"{type(self).__name__} waits are resumed by signals, callbacks and asset events,"
            " not run in a triggerer (a subclass, or a callback token of another task or try?)"
        )
        yield TriggerEvent(None)  # pragma: no cover - makes this an async generator


class SignalTrigger(RowTrigger):
    """Resumes the task with the payload of the next signal sent to ``key``, or of the latest
    one sent within ``lookback`` before the task started waiting; with ``where``, only a signal
    whose payload matches it (:func:`where_predicate`) counts.

    Nothing runs for it in a triggerer: the worker that records the deferral records the wait
    as a row, and ``deferral.signals.send`` resumes the tasks waiting on the key."""

    def __init__(
        self,
        key: str,
        lookback: dt.timedelta = dt.timedelta(0),
        where: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.key = check_signal_key(key)
        self.lookback = check_lookback(lookback)
        where_predicate(where)  # checked now: a bad filter fails the deferral, naming it
        self.where = where

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {"key": self.key, "lookback": self.lookback}
        if self.where is not None:  # (left out otherwise: what was serialized before stays equal)
            kwargs["where"] = self.where
        return classpath_of(SignalTrigger), kwargs


def check_heartbeat(heartbeat: object) -> dt.timedelta | None:
    """A callback's ``heartbeat`` interval: None, or a timedelta of at least a second and at
    most :data:`SIGNAL_RETENTION` (a token's lifetime); else SignalError naming it."""
    if heartbeat is None:
        return None
    if not isinstance(heartbeat, dt.timedelta):
        raise SignalError(f"heartbeat must be a timedelta, got {type(heartbeat).__name__}")
    if not dt.timedelta(seconds=1) <= heartbeat <= SIGNAL_RETENTION:
        raise SignalError(
            f"heartbeat {heartbeat} is out of range: from 1 second to {SIGNAL_RETENTION}"
        )
    return heartbeat


class CallbackTrigger(RowTrigger):
    """Resumes the task when its callback token (``context["callback"].token``, or ``token``)
    is posted to ``POST /api/v1/callbacks/{token}``: with ``event`` the posted payload on
    ``"success"``, failing it (or retrying) with the payload's message on ``"failure"``.

    With ``heartbeat``, the third party must also post to ``.../{token}/heartbeat`` at least
    that often while the task waits (the first within ``heartbeat`` of the deferral): a missed
    heartbeat fails the task (or retries it), naming the heartbeat."""

    def __init__(self, token: str | None = None, heartbeat: dt.timedelta | None = None) -> None:
        super().__init__()
        if token is None:
            token = get_current_context()["callback"].token
        if not isinstance(token, str):
            raise SignalError(f"callback token must be a string, got {type(token).__name__}")
        self.token = token
        self.heartbeat = check_heartbeat(heartbeat)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {"token": self.token}
        if self.heartbeat is not None:  # (left out otherwise: what was serialized before stays)
            kwargs["heartbeat"] = self.heartbeat
        return classpath_of(CallbackTrigger), kwargs


SIGNAL_TRIGGER = classpath_of(SignalTrigger)
CALLBACK_TRIGGER = classpath_of(CallbackTrigger)
