"""Which ``Host`` headers the server answers: the defence against DNS rebinding, where a page of
another site re-points its own name at 127.0.0.1 and reads the UI from the user's browser with
that name as Host. A loopback server answers only loopback names; a server on another address
answers loopback names, its own address, and DEFERRAL_WEBSERVER_ALLOWED_HOSTS (any name if that
is empty)."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def host_name(header: str) -> str:
    """The name of a Host header, without its port, lower case (``[::1]`` keeps brackets)."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    name, colon, port = value.rpartition(":")
    return name if colon and port.isdigit() else value


def _bound_name(bind: str) -> str:
    return f"[{bind.lower()}]" if ":" in bind else bind.lower()


def host_allowed(
    header: str, *, bind: str, loopback_bind: bool, allowed_hosts: Sequence[str]
) -> bool:
    name = host_name(header)
    if name in LOOPBACK_NAMES or name == _bound_name(bind):
        return True
    if name in allowed_hosts or header.strip().lower() in allowed_hosts:
        return True
    return not loopback_bind and not allowed_hosts


class HostCheck:
    """Answers 400 to a request whose Host header this server does not go by."""

    def __init__(
        self, app: ASGIApp, *, bind: str, loopback_bind: bool, allowed_hosts: Sequence[str]
    ) -> None:
        self.app = app
        self.bind = bind
        self.loopback_bind = loopback_bind
        self.allowed_hosts = tuple(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = Headers(scope=scope).get("host", "")
            if not host_allowed(
                header,
                bind=self.bind,
                loopback_bind=self.loopback_bind,
                allowed_hosts=self.allowed_hosts,
            ):
                refused = PlainTextResponse(
                    "bad Host header: this server answers only to its own names"
                    " (DEFERRAL_WEBSERVER_ALLOWED_HOSTS)\n",
                    status_code=400,
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
