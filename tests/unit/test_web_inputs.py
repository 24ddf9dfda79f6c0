"""The web UI's pure guards: the login throttle, parameter checks and the Host check."""

from __future__ import annotations

import pytest

from webserver.hosts import host_allowed, host_name
from webserver.inputs import (
    MAX_JSON_DEPTH,
    BadInput,
    check_id,
    check_urlencoded,
    int_param,
    json_depth,
    loggable_name,
    parse_json,
)
from webserver.throttle import (
    FREE_FAILURES_PER_CLIENT,
    FREE_FAILURES_PER_USER,
    MAX_BACKOFF_SEC,
    LoginThrottle,
    backoff_sec,
)


def test_backoff_doubles_after_the_free_failures_up_to_the_cap() -> None:
    assert [backoff_sec(n, 5) for n in range(1, 10)] == [0, 0, 0, 0, 0, 1, 2, 4, 8]
    assert backoff_sec(10_000, 5) == MAX_BACKOFF_SEC


def test_a_client_is_closed_after_its_free_failures_and_reopens_after_the_backoff() -> None:
    throttle = LoginThrottle()
    for n in range(FREE_FAILURES_PER_CLIENT):
        assert throttle.wait_sec("1.2.3.4", f"user{n}", 0.0) == 0
        throttle.failed("1.2.3.4", f"user{n}", 0.0)
    assert throttle.wait_sec("1.2.3.4", "other", 0.0) == 0
    throttle.failed("1.2.3.4", "other", 0.0)
    assert throttle.wait_sec("1.2.3.4", "anyone", 0.5) == 0.5
    assert throttle.wait_sec("5.6.7.8", "anyone", 0.5) == 0  # another client is not closed
    assert throttle.wait_sec("1.2.3.4", "anyone", 1.0) == 0


def test_a_user_name_is_closed_whatever_client_guesses_and_a_success_reopens_it() -> None:
    throttle = LoginThrottle()
    for n in range(FREE_FAILURES_PER_USER + 1):
        throttle.failed(f"10.0.0.{n}", "ann", 0.0)
    assert throttle.wait_sec("10.9.9.9", "ann", 0.0) > 0
    throttle.succeeded("ann")
    assert throttle.wait_sec("10.9.9.9", "ann", 0.0) == 0


def test_check_id_refuses_control_characters_and_long_ids() -> None:
    assert check_id("run_id", "manual__2024-01-01T00:00:00+00:00").startswith("manual")
    for bad in ("a\x00b", "a\nb", "a\x1b[2J", "a\u2028b", "r" * 251):
        with pytest.raises(BadInput):
            check_id("run_id", bad)


def test_int_param_bounds_integers_of_any_length() -> None:
    assert int_param("3", "try_number", low=1) == 3
    assert int_param(None, "try_number", low=1) is None
    for raw, said in [
        ("x", "must be an integer"),
        ("9" * 5000, "must be between"),
        (str(2**31), "must be between"),
        ("0", "must be between"),
    ]:
        with pytest.raises(BadInput, match=said):
            int_param(raw, "try_number", low=1)


def test_json_depth_ignores_brackets_in_strings_and_parse_json_refuses_deep_nesting() -> None:
    assert json_depth('{"a": [1, {"b": "[[[[{{"}]}') == 3
    assert parse_json('{"a": [1]}', "the body") == {"a": [1]}
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(BadInput, match="the body nests deeper than"):
        parse_json(deep, "the body")
    with pytest.raises(BadInput, match="the body is not valid JSON"):
        parse_json("{nope", "the body")


def test_loggable_name_is_cut_and_escaped() -> None:
    assert loggable_name("ann") == "'ann'"
    said = loggable_name("a\nb\x1b" + "x" * 1000)
    assert "\n" not in said and "\x1b" not in said and said.startswith("'a\\x0ab\\x1b")
    assert said.endswith("(1004 characters)") and len(said) < 120
    assert loggable_name(None) == "''"


@pytest.mark.parametrize(
    ("header", "name"),
    [("LocalHost:8080", "localhost"), ("[::1]:80", "[::1]"), ("[::1]", "[::1]"), ("a.b", "a.b")],
)
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_host_allowed() -> None:
    loopback = {"bind": "127.0.0.1", "loopback_bind": True, "allowed_hosts": ()}
    assert host_allowed("localhost:8080", **loopback)  # type: ignore[arg-type]
    assert not host_allowed("evil.example", **loopback)  # type: ignore[arg-type]
    assert not host_allowed("", **loopback)  # type: ignore[arg-type]
    # Behind a proxy: its names are allowed on a loopback bind too, and nothing else.
    proxied = {"bind": "127.0.0.1", "loopback_bind": True, "allowed_hosts": ("ui.example",)}
    assert host_allowed("ui.example", **proxied)  # type: ignore[arg-type]
    assert not host_allowed("evil.example", **proxied)  # type: ignore[arg-type]
    assert host_allowed("10.1.2.3:8080", bind="10.1.2.3", loopback_bind=False, allowed_hosts=["x"])
    assert not host_allowed("y", bind="0.0.0.0", loopback_bind=False, allowed_hosts=["x"])
    assert host_allowed("anything", bind="0.0.0.0", loopback_bind=False, allowed_hosts=())


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b"a=1&b=%ED%A0%80", "the query string's b is not UTF-8"),
        (b"a=%FF", "the query string's a is not UTF-8"),
        (b"%FF=1", "the query string's \ufffd is not UTF-8"),
        (b"x%00=1", "the query string's x\\x00 must not contain control characters (\\x00)"),
        (b"a=b+%00", "the query string's a must not contain control characters (\\x00)"),
    ],
)
def test_query_fields_not_utf8_or_with_nul_are_refused_naming_the_field(
    raw: bytes, said: str
) -> None:
    with pytest.raises(BadInput) as refused:
        check_urlencoded(raw, "the query string")
    assert str(refused.value) == said


def test_utf8_query_fields_pass() -> None:
    check_urlencoded(b"ok=%E2%9C%93&n=+a&empty=&flag", "the query string")


def test_json_with_nul_or_a_lone_surrogate_is_refused_naming_where() -> None:
    with pytest.raises(BadInput, match=r"^the body: a\[1\] holds a lone surrogate \(\\ud800\)"):
        parse_json('{"a": [1, "\\ud800"]}', "the body")
    with pytest.raises(BadInput, match=r"^the body: a must not contain control characters"):
        parse_json('{"a": "\\u0000"}', "the body")
    assert parse_json('{"a": "\\ud83d\\ude00"}', "the body") == {"a": "\U0001f600"}
