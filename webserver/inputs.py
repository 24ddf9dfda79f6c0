"""What a request may carry: ids, integers and JSON bodies checked before any of them reaches
the database or a parser, so that bad input is a 400 with one line naming it, never a 500 (a
NUL byte fails in PostgreSQL, a 40-digit integer overflows its column, a deeply nested body
exhausts the parser's recursion). Pure functions."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote_plus, unquote_to_bytes

from deferral.runtime import controls, storable

# The columns that hold DAG, run and task ids are VARCHAR(250).
MAX_ID_CHARS = 250
# Integers: a try number, a map index, a count of runs are INTEGER columns or smaller; a log
# line's id is a BIGINT.
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
# Deepest nesting of arrays and objects a JSON body (or a run's conf) may have.
MAX_JSON_DEPTH = 32
# How much of a refused user name a log line keeps.
LOGGED_NAME_CHARS = 64

# A JSON string literal (escapes included): its brackets are not nesting.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class BadInput(ValueError):
    """A request parameter that cannot be used; the message names it."""


def check_id(name: str, value: str) -> str:
    """``value`` if it can be a DAG, run or task id; else BadInput naming ``name``."""
    if len(value) > MAX_ID_CHARS:
        raise BadInput(f"{name} is too long ({len(value)} characters, at most {MAX_ID_CHARS})")
    found = controls.first_control(value)
    if found is not None:
        raise BadInput(f"{name} must not contain control characters ({found})")
    return value


def int_param(raw: str | None, name: str, *, low: int, high: int = MAX_INT32) -> int | None:
    """The integer ``raw`` spells, between ``low`` and ``high`` (None if absent)."""
    if raw is None or raw == "":
        return None
    shown = raw if len(raw) <= 24 else raw[:24] + "…"
    try:
        # Longer digit strings are far out of range anyway (and int() of a huge one is slow).
        value = int(raw[:41])
    except ValueError:
        raise BadInput(f"{name} must be an integer, not {shown!r}") from None
    if len(raw) > 41 or not low <= value <= high:
        raise BadInput(f"{name} must be between {low} and {high}, not {shown}")
    return value


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in the JSON ``text`` (valid or not), counted
    without recursion."""
    depth = deepest = 0
    for ch in _JSON_STRING.sub("", text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(text: str, what: str) -> Any:
    """The JSON ``text``, refused (BadInput naming ``what``) if it is not JSON or nests deeper
    than MAX_JSON_DEPTH."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise BadInput(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(text)
    except ValueError:
        raise BadInput(f"{what} is not valid JSON") from None
    try:
        return storable.check(value, what)
    except storable.UnstorableText as exc:
        raise BadInput(str(exc)) from None


def check_urlencoded(raw: bytes, what: str) -> None:
    """Refuse (BadInput naming ``what`` and the field) a query string or form body whose
    percent-decoded fields are not UTF-8 (a lone surrogate's bytes among them) or hold a NUL:
    Starlette would turn the first into U+FFFD silently and pass the second on."""
    for field in raw.split(b"&"):
        name, _, value = field.partition(b"=")
        shown = controls.escape_all(unquote_plus(name.decode("latin-1"))[:LOGGED_NAME_CHARS])
        for part in (name, value):
            decoded = unquote_to_bytes(part.replace(b"+", b" "))
            try:
                text = decoded.decode("utf-8")
            except UnicodeDecodeError:
                raise BadInput(f"{what}'s {shown} is not UTF-8") from None
            if "\x00" in text:
                raise BadInput(f"{what}'s {shown} must not contain control characters (\\x00)")


def loggable_name(value: object) -> str:
    """A user name as a log line may hold it: its first LOGGED_NAME_CHARS characters, control
    characters escaped, quoted."""
    text = value if isinstance(value, str) else "" if value is None else type(value).__name__
    cut = text[:LOGGED_NAME_CHARS]
    escaped = controls.escape_all(cut)
    more = f"… ({len(text)} characters)" if len(text) > LOGGED_NAME_CHARS else ""
    return f"'{escaped}'{more}"
