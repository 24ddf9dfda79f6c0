"""Control characters in text that came from users: refused in ids, escaped where shown.

A run id with a newline would forge a line in a service's log; an ESC sequence in a task's log
line would drive the terminal of whoever reads it with the CLI (retitle it, hide text, rewrite
what is on screen). Ids refuse them (:func:`check_id`); logs and the CLI escape them
(:func:`escape`), so what is shown is what is there, visibly.
"""

from __future__ import annotations

import re

# Besides C0 (\x00-\x0a are added below): DEL, C1 controls (0x9b is a one-byte CSI), the line
# and paragraph separators some readers break lines at, and the invisible marks that reorder
# what a terminal shows (bidi overrides, isolates: "Trojan source").
_CONTROLS = "\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
# What escape() leaves alone, newline and tab, lay text out; they do not drive a terminal.
_SHOWN_CONTROL = re.compile(f"[\x00-\x08{_CONTROLS}]")
_ANY_CONTROL = re.compile(f"[\x00-\x0a{_CONTROLS}]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with every control character but newline and tab written as ``\\xNN`` or
    ``\\uNNNN``."""
    return _SHOWN_CONTROL.sub(_escaped, text)


def escape_all(text: str) -> str:
    """``text`` with every control character, newline and tab too, written as ``\\xNN``."""
    return _ANY_CONTROL.sub(_escaped, text)


def first_control(text: str) -> str | None:
    """The first control character in ``text`` as it would be escaped (``\\x00``), or None."""
    match = _ANY_CONTROL.search(text)
    return None if match is None else _escaped(match)


def check_id(value: str, what: str) -> str:
    """``value`` if it holds no control character; else ValueError naming ``what`` and the
    character (a newline in a run id would forge log lines, a NUL cannot be stored)."""
    found = first_control(value)
    if found is not None:
        raise ValueError(f"{what} '{escape_all(value)}' holds the control character {found}")
    return value
