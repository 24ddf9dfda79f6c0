"""tests/redis_cli_docs.py: the Operations page's redis-cli examples, and the rule that compares
what redis-cli prints with them (names exact; ids, counts and tokens by kind)."""

from __future__ import annotations

from pathlib import Path

from tests.redis_cli_docs import differences, examples

DOCUMENTED = [
    '1) 1) "1718900000123-0"',
    '   2) 1) "trigger_id"',
    '      2) "1"',
    '      3) "task"',
    '      4) "a.manual__2024.wait"',
]


def _printed(*changes: tuple[int, str]) -> list[str]:
    lines = [
        '1) 1) "1795470595409-0"',
        '   2) 1) "trigger_id"',
        '      2) "42"',
        '      3) "task"',
        '      4) "b.manual__2026.other"',
    ]
    for index, line in changes:
        lines[index] = line
    return lines


def test_ids_values_and_counts_may_differ() -> None:
    assert differences(DOCUMENTED, _printed()) == []
    assert differences(["(integer) 1"], ["(integer) 93"]) == []


def test_a_renamed_field_is_a_difference() -> None:
    assert differences(DOCUMENTED, _printed((1, '   2) 1) "trigger"'))) == [
        'line 2: "trigger" where "trigger_id"'
    ]


def test_other_nesting_another_kind_or_other_lines_are_differences() -> None:
    assert differences(DOCUMENTED, _printed((2, '   2) "42"'))) != []
    assert differences(DOCUMENTED, _printed((2, "      2) (integer) 42"))) != []
    assert differences(DOCUMENTED, _printed()[:-1]) == ["4 lines printed, 5 documented"]


def test_examples_are_the_dollar_lines_of_the_sections_console_blocks(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "## Operations\n\n### Inspecting with redis-cli\n\nText.\n\n```console\n"
        '$ redis-cli XLEN deferral:dead\n(integer) 0\n$ redis-cli HGETALL k\n1) "a"\n2) "b"\n'
        "```\n\n### Next\n\n```console\n$ redis-cli NOT THIS\n```\n"
    )
    found = examples(readme)
    assert [(e.command, e.output) for e in found] == [
        (["XLEN", "deferral:dead"], ["(integer) 0"]),
        (["HGETALL", "k"], ['1) "a"', '2) "b"']),
    ]


def test_the_docs_have_the_examples_the_end_to_end_test_runs() -> None:
    commands = [" ".join(e.command[:2]) for e in examples()]
    assert "XRANGE deferral:triggers" in commands
    assert "XPENDING deferral:triggers" in commands
    assert "XINFO GROUPS" in commands
    assert "HGETALL deferral:inflight:triggers" in commands
