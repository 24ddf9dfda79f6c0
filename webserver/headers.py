"""The headers every answer carries: scripts and styles from this server only, no framing, no
sniffing, and ``no-store`` on everything but static files."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Scripts and styles come from this server only and inline ones never run: escaping is the first
# defence against a task id or a log line holding markup, this is the second.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        " object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
}


def _security_headers(static: bool) -> list[tuple[bytes, bytes]]:
    extra = dict(SECURITY_HEADERS)
    if not static:
        extra["cache-control"] = "no-store"
    return [(k.encode(), v.encode()) for k, v in extra.items()]


_PAGE_HEADERS, _STATIC_HEADERS = _security_headers(False), _security_headers(True)


def secured(send: Send, *, static: bool = False) -> Send:
    """``send`` adding SECURITY_HEADERS to the response (and ``no-store`` but for static
    files)."""

    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            headers += _STATIC_HEADERS if static else _PAGE_HEADERS
            message["headers"] = headers
        await send(message)

    return send_with_headers


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every response (and ``no-store`` to pages and API answers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, secured(send, static=scope["path"].startswith("/static/")))
