"""The "Inspecting with redis-cli" examples of docs/operations.md, read from the page itself,
and the rule that says whether what redis-cli prints has the documented shape.

Each example in that section's ``console`` blocks is a ``$ redis-cli ...`` line followed by the
output redis-cli prints on a terminal. Two outputs have the same shape when they have the same
lines, each line with the same nesting (``1) 2)`` markers and indentation) and the same kind of
value (string, integer, nil); a documented string that is a name (lower-case letters, digits,
``-`` and ``_``, starting with a letter: field names, group and consumer names, event kinds)
must be printed as it is, while ids, counts, tokens and times may differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
SECTION = "### Inspecting with redis-cli"
# The key prefix the documented commands use (DEFERRAL_STREAM_PREFIX's default).
DOCUMENTED_PREFIX = "deferral:"

_LINE = re.compile(r"^(?P<nesting>(?:\s*\d+\)\s)*)\s*(?P<value>.*)$")
_NAME = re.compile(r'^"[a-z][a-z0-9_-]*"$')


@dataclass(frozen=True)
class Example:
    command: list[str]  # after "redis-cli"
    output: list[str]


def examples(readme: Path = OPERATIONS) -> list[Example]:
    """Every ``$ redis-cli`` example of the section, in order."""
    text = readme.read_text()
    start = text.index(SECTION)
    end = text.find("\n#", start + len(SECTION))
    section = text[start : end if end != -1 else len(text)]
    found: list[Example] = []
    for block in re.findall(r"```console\n(.*?)```", section, flags=re.DOTALL):
        for line in block.splitlines():
            if line.startswith("$ "):
                words = line[2:].split()
                if words[0] != "redis-cli":
                    raise ValueError(f"not a redis-cli example: {line!r}")
                found.append(Example(words[1:], []))
            elif found:
                found[-1].output.append(line)
    return found


def _kind(value: str) -> str:
    if value.startswith('"'):
        return "string"
    if value.startswith("(integer)"):
        return "integer"
    return value  # (nil), (empty array) ...


def differences(documented: list[str], printed: list[str]) -> list[str]:
    """How ``printed`` departs from the ``documented`` shape (empty: same shape)."""
    if len(documented) != len(printed):
        return [f"{len(printed)} lines printed, {len(documented)} documented"]
    found = []
    for number, (doc, out) in enumerate(zip(documented, printed, strict=True), start=1):
        doc_match, out_match = _LINE.match(doc), _LINE.match(out)
        assert doc_match and out_match  # the pattern matches any line
        if doc_match["nesting"] != out_match["nesting"]:
            found.append(f"line {number}: nesting {out!r}, documented {doc!r}")
        elif _NAME.match(doc_match["value"]):
            if out_match["value"] != doc_match["value"]:
                found.append(f"line {number}: {out_match['value']} where {doc_match['value']}")
        elif _kind(doc_match["value"]) != _kind(out_match["value"]):
            found.append(f"line {number}: {out!r} is not like the documented {doc!r}")
    return found
