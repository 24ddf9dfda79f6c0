"""What PostgreSQL cannot store (NUL, lone surrogates): refused in input with one line naming
where, escaped in what machines send."""

from __future__ import annotations

from typing import Any

import pytest

from deferral.runtime.storable import UnstorableText, check, storable, storable_text


def test_nul_and_lone_surrogates_are_escaped_and_the_rest_kept() -> None:
    assert storable_text("a\x00b\ud800c\udfff😀") == "a\\x00b\\ud800c\\udfff😀"
    value = {"k\x00": ["\ud800", 1, None, {"x": ("y\x00",)}], "n": 1.5}
    assert storable(value) == {"k\\x00": ["\\ud800", 1, None, {"x": ("y\\x00",)}], "n": 1.5}
    assert storable_text("\ud800\x00").encode("utf-8") == b"\\ud800\\x00"


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("a\x00", "conf must not contain control characters (\\x00)"),
        ({"a": [1, "\ud800"]}, "conf: a[1] holds a lone surrogate (\\ud800), which is not Unicode"),
        ({"a": {"b\x00": 1}}, "conf: a key of a must not contain control characters (\\x00)"),
        ({"\udc80": 1}, "conf: a key holds a lone surrogate (\\udc80)"),
        ({"x" * 200: "\x00"}, "conf: " + "x" * 80 + "… must not contain"),
    ],
)
def test_input_with_them_is_refused_in_one_line_naming_where(value: Any, said: str) -> None:
    with pytest.raises(UnstorableText) as refused:
        check(value, "conf")
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_text_without_them_passes_as_it_is() -> None:
    value = {"a": ["ok", "😀", "\n\t", 1, None]}
    assert check(value, "conf") is value
