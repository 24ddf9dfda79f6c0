"""Text PostgreSQL cannot store: the NUL character (``text`` and ``jsonb`` refuse it) and lone
surrogates (they are no Unicode text: UTF-8 cannot encode them, ``jsonb`` refuses their
``\\ud800`` escape). JSON bodies, argv (Python decodes bad bytes to surrogates) and event
sources can all carry them.

Two answers, one per kind of source, decided here for every path that writes text, events or
payloads:

- input a person sent (a request, a command's argument) is refused, naming where the character
  is (:func:`check`), so the sender learns and nothing is stored half-changed;
- what a machine produced with nobody to answer (an asset watcher's entries, a task's log
  lines) is stored with each such character escaped as its visible ``\\x00`` / ``\\ud800``
  spelling (:func:`storable`, :func:`storable_text`): the rest of the entry is kept, and what
  was there is shown.
"""

from __future__ import annotations

import re
from typing import Any

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Paths in messages are cut to this many characters (a key may be long).
_SHOWN_PATH_CHARS = 80


class UnstorableText(ValueError):
    """A NUL or a lone surrogate in input; the message names where it is."""


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return "\\x00" if code == 0 else f"\\u{code:04x}"


def storable_text(text: str) -> str:
    """``text`` with each NUL and lone surrogate written as ``\\x00`` / ``\\udXXX``."""
    return _UNSTORABLE.sub(_escaped, text)


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (bytes that were not UTF-8, decoded with
    ``surrogateescape`` as Python does argv, or a JSON ``\\ud800`` escape)."""
    return _LONE_SURROGATE.search(text) is not None


def storable(value: Any) -> Any:
    """A JSON-like ``value`` (dicts, lists, tuples, strings, scalars) with every string and key
    made :func:`storable_text` (tuples stay tuples); other values are returned as they are."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(item) for item in value]
    if isinstance(value, tuple):
        return tuple(storable(item) for item in value)
    return value


def _first(value: Any, path: str) -> tuple[str, str] | None:
    """(where, the character escaped) of the first unstorable character in ``value``."""
    if isinstance(value, str):
        found = _UNSTORABLE.search(value)
        return None if found is None else (path, _escaped(found))
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (found := _UNSTORABLE.search(key)) is not None:
                return f"a key of {path}" if path else "a key", _escaped(found)
            shown = storable_text(key) if isinstance(key, str) else repr(key)
            inside = _first(item, f"{path}.{shown}" if path else shown)
            if inside is not None:
                return inside
    elif isinstance(value, list | tuple):
        for position, item in enumerate(value):
            inside = _first(item, f"{path}[{position}]")
            if inside is not None:
                return inside
    return None


def check(value: Any, what: str = "") -> Any:
    """``value`` if no string or key in it holds a NUL or a lone surrogate; else UnstorableText
    naming ``what``, the place in it (``conf.a[2]``) and the character (``what`` may be left
    out where the caller names the value itself and ``value`` is a dict or list)."""
    found = _first(value, "")
    if found is None:
        return value
    where, char = found
    if len(where) > _SHOWN_PATH_CHARS:
        where = where[:_SHOWN_PATH_CHARS] + "…"
    place = f"{what}: {where}" if what and where else what or where
    if char == "\\x00":
        raise UnstorableText(f"{place} must not contain control characters (\\x00)")
    raise UnstorableText(f"{place} holds a lone surrogate ({char}), which is not Unicode text")
