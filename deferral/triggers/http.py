"""A trigger that polls an HTTP endpoint until it answers with the expected status."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of

# One request may take this long; a slow endpoint then counts as "not yet", not as a failure.
_REQUEST_TIMEOUT_SEC = 30.0


def _status_of(url: str) -> int | None:
    """The HTTP status of GET ``url``, or None if it could not be reached."""
    try:
        with urllib.request.urlopen(url, timeout=_REQUEST_TIMEOUT_SEC) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


class HttpTrigger(BaseTrigger):
    """Fires when GET ``url`` answers ``expected_status``; polls every ``poll_interval`` seconds.
    The request runs off the event loop. The event payload is ``{"url", "status"}``."""

    def __init__(self, url: str, expected_status: int = 200, poll_interval: float = 30.0) -> None:
        super().__init__()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        if isinstance(expected_status, bool) or not isinstance(expected_status, int):
            raise TypeError(f"expected_status must be an int, got {expected_status!r}")
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)):
            raise TypeError(f"poll_interval must be a number, got {poll_interval!r}")
        if poll_interval <= 0:
            raise ValueError("poll_interval must be greater than 0")
        self.url = url
        self.expected_status = expected_status
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(HttpTrigger), {
            "url": self.url,
            "expected_status": self.expected_status,
            "poll_interval": self.poll_interval,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while (status := await anyio.to_thread.run_sync(_status_of, self.url)) != (
            self.expected_status
        ):
            await anyio.sleep(self.poll_interval)
        yield TriggerEvent({"url": self.url, "status": status})
