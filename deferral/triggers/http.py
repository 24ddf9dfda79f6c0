"""A trigger that polls an HTTP endpoint until it answers with the expected status.

Its URL may carry secrets (``https://user:password@host/...``, ``?token=...``, often from a
secret Variable): they go to the endpoint and nowhere else. User info becomes HTTP Basic auth
(only the host goes to the resolver, and the header is not passed on to where a redirect
points), and the event payload, which the events stream, the logs and the UI show, names the
URL without its user info, query string and fragment.
"""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

import anyio

from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of

# One request may take this long; a slow endpoint then counts as "not yet", not as a failure.
_REQUEST_TIMEOUT_SEC = 30.0


def _host_part(parts: SplitResult) -> str:
    """``host[:port]`` of a URL, without its user info."""
    return parts.netloc.rpartition("@")[2]


def shown_url(url: str) -> str:
    """``url`` as it may be shown: scheme, host, port and path; no user info, query, fragment."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{_host_part(parts)}{parts.path}"


def request_for(url: str) -> urllib.request.Request:
    """A GET of ``url`` whose user info, if any, is an ``Authorization: Basic`` header instead."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return urllib.request.Request(url)
    bare = parts._replace(netloc=_host_part(parts)).geturl()
    request = urllib.request.Request(bare)
    credentials = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    basic = base64.b64encode(credentials.encode()).decode("ascii")
    # Unredirected: a redirect to another host does not take the credentials with it.
    request.add_unredirected_header("Authorization", f"Basic {basic}")
    return request


def _status_of(url: str) -> int | None:
    """The HTTP status of GET ``url``, or None if it could not be reached."""
    try:
        with urllib.request.urlopen(request_for(url), timeout=_REQUEST_TIMEOUT_SEC) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


class HttpTrigger(BaseTrigger):
    """Fires when GET ``url`` answers ``expected_status``; polls every ``poll_interval`` seconds.
    The request runs off the event loop. The event payload is ``{"url", "status"}``, the URL
    without its user info, query string and fragment (see :func:`shown_url`)."""

    def __init__(self, url: str, expected_status: int = 200, poll_interval: float = 30.0) -> None:
        super().__init__()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            # The URL itself is not repeated: it may hold a password.
            got = url.partition(":")[0] + ":..." if isinstance(url, str) else type(url).__name__
            raise ValueError(f"url must be an http:// or https:// URL, got {got[:40]}")
        try:
            urlsplit(url).port  # noqa: B018 - refused now rather than at every poll
        except ValueError:
            raise ValueError(f"url has an invalid port: {shown_url(url)}") from None
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
        yield TriggerEvent({"url": shown_url(self.url), "status": status})
