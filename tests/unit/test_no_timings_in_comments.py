"""No measured timing in the code's comments and docstrings: a comment says why, the figure that
decided it goes to benchmarks/README.md ("Figures behind code choices"), where it is dated and
can be measured again. A sentence that names a duration and a word of measurement ("took 5 s",
"costs 10 µs", "p50 9 ms") is taken for one; a duration the code sets (a timeout, a bound) has
no such word beside it."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_layers import PROJECT

REPO = Path(__file__).resolve().parents[2]
DURATION = re.compile(r"\b\d[\d,.]*\s?(?:µs|us|ms|s|seconds|milliseconds|microseconds)\b")
MEASURED = re.compile(
    r"\b(?:took|cost|costs|measured|seen|p50|p99|faster|quicker|slower|sooner|held|spent"
    r"|instead of)\b|~\s?\d",
    re.IGNORECASE,
)
# Sentences that name a duration beside such a word without quoting a measurement.
NOT_MEASUREMENTS = {
    # What the lease thread guarantees, for any length of blocking.
    "that holds the loop in synchronous code for 30 s delays its neighbours",
}


def sentences(text: str) -> list[str]:
    return [" ".join(part.split()) for part in re.split(r"(?<=[.;])\s+", text)]


def commentary(source: str) -> Iterator[tuple[int, str]]:
    """Each sentence of the comments (consecutive comment lines read as one text; a comment
    after code on its line alone) and of the docstrings of ``source``, with the line it starts
    on."""
    block: list[str] = []
    start = previous = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        alone = token.line.lstrip().startswith("#")  # not after code on its line
        if block and (line != previous + 1 or not alone):
            yield from ((start, s) for s in sentences(" ".join(block)))
            block = []
        if not block:
            start = line
        block.append(token.string.lstrip("#"))
        previous = line if alone else -1
    yield from ((start, s) for s in sentences(" ".join(block)))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                line = node.body[0].lineno
                yield from ((line, s) for s in sentences(doc))


def timings(source: str) -> list[tuple[int, str]]:
    return [
        (line, sentence)
        for line, sentence in commentary(source)
        if DURATION.search(sentence)
        and MEASURED.search(sentence)
        and not any(allowed in sentence for allowed in NOT_MEASUREMENTS)
    ]


def test_a_quoted_measurement_is_found_and_a_set_duration_is_not() -> None:
    source = (
        '"""Reads the stream; a block of 1 ms at least."""\n'
        "TIMEOUT = 5  # seconds: a run fails at most 5 s after it\n"
        "# Batched: one call per id\n"
        "# cost 10 µs each.\n"
        "def f() -> None:\n"
        '    """Quick. The join took 16 ms at 10,000 ids."""\n'
    )
    assert [line for line, _ in timings(source)] == [3, 6]


@pytest.mark.parametrize("package", sorted(PROJECT))
def test_no_comment_quotes_a_measured_timing(package: str) -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {sentence}"
        for path in sorted((REPO / package).rglob("*.py"))
        for line, sentence in timings(path.read_text())
    ]
    assert found == [], "move the figure to benchmarks/README.md, keep the reason"
