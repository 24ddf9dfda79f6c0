"""Turning a ``deferral:triggers`` entry into a trigger instance, refusing anything unsafe.

A stream entry must never make the triggerer import arbitrary code: the classpath comes from the
authenticated token (the clear field must agree with it), its module must sit under an allowed
prefix, and the class must be a BaseTrigger subclass. Each refusal names its reason.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TypeVar

import msgspec

from broker.replies import Entry
from broker.streams import MalformedEntry, TriggerMessage, TriggerSpec, from_fields
from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.runtime.serialization import SerializationError, from_jsonable
from deferral.triggers.base import BaseTrigger

T = TypeVar("T")


class RejectedEntry(ValueError):
    """The entry cannot be run; ``trigger_id`` is the id it names, if it names one, and
    ``authentic`` whether its token proved it ours: only then may its task be failed (a forged
    or corrupted entry changes nothing; if it was ours, the reconciler publishes it again)."""

    def __init__(self, message: str, trigger_id: int | None, *, authentic: bool = False) -> None:
        super().__init__(message)
        self.trigger_id = trigger_id
        self.authentic = authentic


@dataclass(frozen=True)
class Decoded:
    spec: TriggerSpec
    trigger: BaseTrigger


def _clear_trigger_id(entry: Entry) -> int | None:
    raw = entry.fields.get(b"trigger_id", b"")
    return int(raw) if raw.isdigit() else None


def module_allowed(module: str, prefixes: Sequence[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# Classes loaded, by classpath and allowed prefixes, with their module: a takeover builds a
# thousand triggers of one class at a time. Loaded again once its module is no longer the one
# imported (a DAGs-folder module run afresh).
_loaded: dict[tuple[str, tuple[str, ...]], tuple[ModuleType, type[BaseTrigger]]] = {}


def load_trigger_class(classpath: str, prefixes: Sequence[str]) -> type[BaseTrigger]:
    key = (classpath, tuple(prefixes))
    loaded = _loaded.get(key)
    if loaded is not None and sys.modules.get(loaded[0].__name__) is loaded[0]:
        return loaded[1]
    cls = _load_trigger_class(classpath, prefixes)
    _loaded[key] = (sys.modules[classpath.rpartition(".")[0]], cls)
    return cls


def _load_trigger_class(classpath: str, prefixes: Sequence[str]) -> type[BaseTrigger]:
    module_name, _, class_name = classpath.rpartition(".")
    if not module_name or not module_allowed(module_name, prefixes):
        raise ValueError(f"trigger class {classpath!r} is outside DEFERRAL_TRIGGER_MODULES")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseTrigger)):
        raise ValueError(f"{classpath!r} is not a BaseTrigger subclass")
    return cls


def _rejecting(entry: Entry, step: Callable[[], T]) -> T:
    """``step()``, whatever goes wrong a rejection: an entry must never be able to crash the
    triggerer, or it would crash every triggerer that takes it over in turn."""
    try:
        return step()
    except RejectedEntry:
        raise
    except Exception as exc:
        raise RejectedEntry(
            f"rejected trigger entry: {type(exc).__name__}: {exc}", _clear_trigger_id(entry)
        ) from None


def open_spec(entry: Entry, cipher: Cipher) -> TriggerSpec:
    """The spec an entry's token holds, authenticated as a trigger spec and agreeing with the
    entry's clear fields; RejectedEntry saying why not. Nothing is imported or built yet: the
    triggerer first checks the spec against PostgreSQL (:func:`broker.trigger_rows.spec_check`)."""
    return _rejecting(entry, lambda: _open(entry, cipher))


def instantiate(entry: Entry, spec: TriggerSpec, prefixes: Sequence[str]) -> Decoded:
    """The trigger a checked spec asks for; RejectedEntry (authentic) saying why not."""
    return _rejecting(entry, lambda: _instantiate(spec, prefixes))


def decode_entry(entry: Entry, cipher: Cipher, prefixes: Sequence[str]) -> Decoded:
    """:func:`open_spec` then :func:`instantiate`, with no check against PostgreSQL in between
    (the service puts one there)."""
    return instantiate(entry, open_spec(entry, cipher), prefixes)


def _open(entry: Entry, cipher: Cipher) -> TriggerSpec:
    trigger_id = _clear_trigger_id(entry)
    try:
        message = from_fields(TriggerMessage, entry.fields)
        spec = msgspec.json.decode(
            cipher.decrypt(Purpose.TRIGGER_SPEC, message.token), type=TriggerSpec
        )
    except (MalformedEntry, DecryptionError, msgspec.DecodeError) as exc:
        raise RejectedEntry(f"rejected trigger entry: {exc}", trigger_id) from None
    if message.trigger_id != str(spec.trigger_id) or message.classpath != spec.classpath:
        raise RejectedEntry("rejected trigger entry: fields disagree with its token", trigger_id)
    return spec


def _instantiate(spec: TriggerSpec, prefixes: Sequence[str]) -> Decoded:
    try:
        cls = load_trigger_class(spec.classpath, prefixes)
        kwargs = from_jsonable(spec.kwargs)
        for nested in cls.nested_classpaths(kwargs):
            load_trigger_class(nested, prefixes)
    except (ValueError, SerializationError) as exc:
        raise RejectedEntry(
            f"rejected trigger {spec.trigger_id}: {exc}", spec.trigger_id, authentic=True
        ) from None
    try:
        trigger = cls(**kwargs)
    except Exception as exc:
        raise RejectedEntry(
            f"trigger {spec.trigger_id} ({spec.classpath}) constructor raised "
            f"{type(exc).__name__}: {exc}",
            spec.trigger_id,
            authentic=True,
        ) from None
    trigger.trigger_id = spec.trigger_id
    return Decoded(spec, trigger)
