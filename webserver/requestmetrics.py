"""Counts and times every HTTP request for ``deferral_webserver_requests_total`` and
``deferral_webserver_request_seconds``, labelled by the route's path pattern (``/dags/{dag_id}``),
never the path itself: label values an attacker could choose would grow the series without bound.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deferral.runtime import metrics

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"


def route_label(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The path pattern of the route ``scope`` reaches, or ``unmatched``: the one the router
    matched (Starlette notes it in the scope), else matched again here."""
    matched = scope.get("route")
    if isinstance(matched, Mount):
        return f"{matched.path}/{{path}}"
    if isinstance(matched, Route):
        return matched.path
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:  # PARTIAL: the path matches, the method does not
            if isinstance(route, Mount):
                return f"{route.path}/{{path}}"
            if isinstance(route, Route):
                return route.path
    return UNMATCHED


class RequestMetrics:
    """Outermost middleware: what every request got, refused ones included."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = route_label(self.routes, scope)
            method = scope["method"] if scope["method"] in METHODS else "other"
            metrics.WEB_REQUESTS.labels(method, route, str(status)).inc()
            metrics.WEB_REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)
