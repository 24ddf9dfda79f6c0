"""The machines' path: a POST to a route an API token serves (``api.TOKEN_PATHS``: signals, run
triggers, callbacks) that sends a token goes straight to the route's guarded handler, past the
browser's middlewares (the session cookie's, the router's, the exception handlers') that
such a request never uses: a machine's signals are many small requests, each paying for every
layer. What the guard does is unchanged (``WebUI.api_actor``, ``WebUI.token_optional``: the
token, its scope, the JSON body, the rate limit, the answers), and so are the answer's headers
(``app.secured``), the metrics (the route is noted in the scope, as the router notes it), the
Host check and the body limit, which stay in front.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from webserver.answers import api_error
from webserver.headers import secured


def sends_bearer(scope: Scope) -> bool:
    """Whether the request's (first) Authorization header is ``Bearer ...``, as
    ``auth.has_bearer`` reads it."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bool(value.partition(b" ")[0].lower() == b"bearer")
    return False


class MachinePath:
    def __init__(self, app: ASGIApp, routes: Sequence[Route]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and sends_bearer(scope):
            for route in self.routes:
                match, child = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child)
                    scope["route"] = route
                    await self._serve(route, scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _serve(route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await route.endpoint(Request(scope, receive))
        except HTTPException as exc:  # the body limit's 413, answered as the application does
            response = api_error(exc.status_code, str(exc))
        await response(scope, receive, secured(send))
