"""HttpTrigger against a real HTTP server on loopback."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import urlsplit

import anyio
import pytest

from deferral.triggers import HttpTrigger, TriggerEvent
from deferral.triggers.http import shown_url


class _Endpoint(BaseHTTPRequestHandler):
    answers: ClassVar[list[int]] = []
    seen: ClassVar[list[tuple[str, str | None]]] = []  # (path, Authorization header)

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        status = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/job"
    server.shutdown()


async def _first_event(trigger: HttpTrigger) -> TriggerEvent:
    with anyio.fail_after(10):
        async for event in trigger.run():
            return event
    raise AssertionError("no event")


def test_fires_once_the_endpoint_answers_the_expected_status(endpoint: str) -> None:
    _Endpoint.answers = [503, 404, 200]
    event = anyio.run(_first_event, HttpTrigger(endpoint, 200, poll_interval=0.01))
    assert event.payload == {"url": endpoint, "status": 200}
    assert _Endpoint.answers == [200]  # it polled through 503 and 404 first


def test_an_unreachable_endpoint_is_polled_not_failed() -> None:
    trigger = HttpTrigger("http://127.0.0.1:9/", 200, poll_interval=0.01)  # discard port

    async def poll_a_while() -> None:
        with anyio.move_on_after(0.3):
            async for _ in trigger.run():
                raise AssertionError("must not fire")

    anyio.run(poll_a_while)


def test_serializes_to_its_own_classpath() -> None:
    trigger = HttpTrigger("https://example.invalid/x", 204, poll_interval=5)
    assert trigger.serialize() == (
        "deferral.triggers.http.HttpTrigger",
        {"url": "https://example.invalid/x", "expected_status": 204, "poll_interval": 5},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("ftp://x",), "http:// or https://"),
        (("http://x", "200"), "expected_status must be an int"),
        (("http://x", 200, 0), "greater than 0"),
        (("http://x", 200, "5"), "poll_interval must be a number"),
    ],
)
def test_bad_arguments_are_refused_when_deferring(args: tuple[object, ...], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        HttpTrigger(*args)  # type: ignore[arg-type]


def test_user_info_is_sent_as_basic_auth_and_only_the_host_is_resolved(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved: list[str] = []
    real_getaddrinfo = socket.getaddrinfo

    def recording_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        resolved.append(host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", recording_getaddrinfo)
    _Endpoint.answers, _Endpoint.seen = [200], []
    port = urlsplit(endpoint).port
    secret_url = f"http://us%40er:s3cr%3At-pw@localhost:{port}/job?token=q-s3cret"
    event = anyio.run(_first_event, HttpTrigger(secret_url, 200, poll_interval=0.01))
    credentials = base64.b64encode(b"us@er:s3cr:t-pw").decode()
    assert _Endpoint.seen == [("/job?token=q-s3cret", f"Basic {credentials}")]
    assert resolved and set(resolved) == {"localhost"}  # never "us%40er:s3cr%3At-pw@localhost"
    assert event.payload == {"url": f"http://localhost:{port}/job", "status": 200}
    assert "s3cr" not in repr(event.payload)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://u:pw@h.example:8443/p/q?token=t&x=1#frag", "https://h.example:8443/p/q"),
        ("http://h/?apikey=k", "http://h/"),
        ("https://h/path", "https://h/path"),
    ],
)
def test_the_shown_url_has_no_user_info_query_or_fragment(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_a_refused_url_is_not_repeated_in_the_error() -> None:
    with pytest.raises(ValueError) as refused:
        HttpTrigger("ftp://user:s3cret-pw@h/")
    assert "s3cret" not in str(refused.value)
