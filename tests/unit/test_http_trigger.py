"""HttpTrigger against a real HTTP server on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import anyio
import pytest

from deferral.triggers import HttpTrigger, TriggerEvent


class _Endpoint(BaseHTTPRequestHandler):
    answers: ClassVar[list[int]] = []

    def do_GET(self) -> None:
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
