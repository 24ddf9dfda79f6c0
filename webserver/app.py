"""The ASGI application: pages (Jinja2, autoescaped; `pages`), the JSON API under ``/api/v1/``
(`api`), and the user actions (`forms`), which take the ``deferral`` command's own paths
(``deferral.store.actions``, through `writes`); what they show is read by `reads` from
`readmodel`. Here: who may do what, how an answer is rendered, and the application itself.

Database and Redis calls are blocking, so they run in Starlette's thread pool. Pages read the
DAGs the schedulers parsed (``readmodel.dags``), and so do the writes (trigger, pause, clear,
mark); only the trigger of a DAG whose timetable is its file's own class reads the DAGs folder
(``webserver.dagfiles``; readmodel/DECISIONS.md 7).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from broker.client import Broker
from broker.streams import WAKE
from deferral.runtime import secrets_masker
from deferral.runtime.config import Settings, WebserverSettings, webserver_settings
from deferral.runtime.crypto import Cipher
from deferral.store import actions
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.idempotency import IdempotencyConflict
from readmodel import dags
from readmodel.errors import NotFound, server_error
from readmodel.pages import BadCursor
from readmodel.records import json_value
from webserver import approvals, users
from webserver.answers import api_error, basic_refused, no_token_here, token_acting
from webserver.api import TOKEN_PATHS, Api
from webserver.auth import (
    CSRF_FIELD,
    CSRF_HEADER,
    SESSION_COOKIE,
    Auth,
    has_bearer,
    is_loopback,
    session_key,
)
from webserver.dagfiles import DagFiles
from webserver.forms import Forms, checked_form
from webserver.headers import SecurityHeaders
from webserver.hosts import HostCheck
from webserver.inputs import BadInput, check_id, check_urlencoded, parse_json
from webserver.machine import MachinePath
from webserver.pages import Pages
from webserver.ratelimits import WriteLimits
from webserver.reads import Reads
from webserver.requestmetrics import RequestMetrics
from webserver.signalbatch import SignalBatches
from webserver.urls import API, dag_url, here, log_url, ti_url
from webserver.urls import safe_next as _safe_next
from webserver.writes import Writes

log = logging.getLogger("deferral.webserver")

HERE = Path(__file__).resolve().parent
# A form or an API body larger than this is refused (a run's conf is small).
MAX_BODY_BYTES = 1024 * 1024
# The header the page script's live refresh sends.
LIVE_HEADER = "x-deferral-live"
# Every page refreshes its live parts this often (milliseconds), while it is visible.
REFRESH_MS = 2000

# -- formatting helpers for the templates --------------------------------------------------------


def _when(value: dt.datetime | str | None) -> str:
    """A time as every page shows one; an ISO 8601 string too (the pages that show what their
    API answers, as Required actions does)."""
    if value is None:
        return "-"
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    # Every time the UI shows is in UTC, and says so.
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(abs(seconds))
    sign = "-" if seconds < 0 else ""
    if whole < 60:
        return f"{sign}{abs(seconds):.1f}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{sign}{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{sign}{hours}h {minutes:02d}m"
    return f"{sign}{hours // 24}d {hours % 24:02d}h"


def _pretty_json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, indent=2, default=json_value)


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(when=_when, duration=_duration, pretty_json=_pretty_json)
    env.globals.update(
        dag_url=dag_url,
        ti_url=ti_url,
        log_url=log_url,
        api=API,
        refresh_ms=REFRESH_MS,
        max_graph_tasks=dags.MAX_GRAPH_TASKS,
        csrf_field=CSRF_FIELD,
    )
    return Jinja2Templates(env=env)


Handler = Callable[[Request], Awaitable[Response]]


class WebUI:
    def __init__(
        self,
        settings: Settings,
        web: WebserverSettings,
        *,
        host: str,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.sessions: sessionmaker[Session] = make_sessionmaker(make_engine(settings.database_url))
        self.dag_files = DagFiles(settings.dags_folder, settings.dagbag_import_timeout)
        # One per process: each purpose's keys are derived once, not per request.
        self.cipher = Cipher(settings.fernet_keys)
        self.auth = Auth(
            self.sessions,
            session_key(settings),
            self.cipher,
            # Allowed host names mean a proxy in front: others than this machine connect.
            open_reads=is_loopback(host) and not web.allowed_hosts,
            session_lifetime=web.session_lifetime,
            environ=environ,
        )
        self.templates = _templates()
        self.web = web
        self.limits = WriteLimits(web)
        self._broker: Broker | None = None
        self.signal_batches = SignalBatches(self.sessions, self.cipher, self.wake_scheduler)
        # What must never show, whatever a page prints: the Fernet keys, the admin password.
        for secret in (*settings.fernet_keys, users.admin_password(environ)):
            if secret:
                secrets_masker.mask_secret(secret)

    def broker(self) -> Broker:
        if self._broker is None:
            self._broker = Broker.from_url(
                self.settings.redis_url,
                self.settings.stream_prefix,
                shards=self.settings.stream_shards,
            )
        return self._broker

    def wake_scheduler(self) -> None:
        """Tell the schedulers that tasks were resumed: they queue them now, not when their
        wait for events ends."""
        broker = self.broker()
        broker.publish(broker.keys.events, WAKE)

    # -- responses ---------------------------------------------------------------------------

    async def page(
        self, request: Request, template: str, context: dict[str, Any], status_code: int = 200
    ) -> Response:
        user = await run_in_threadpool(self.auth.session_user, request)
        # A live refresh leaves the messages to the page a click loads (and the cookie alone).
        live = request.headers.get(LIVE_HEADER) == "1"
        flashes = [] if live else request.session.pop("flash", [])
        variables = {
            "request": request,
            "user": user,
            "open_reads": self.auth.open_reads,
            "csrf_token": self.auth.csrf_token(request),
            "flashes": flashes if isinstance(flashes, list) else [],
            "path": request.url.path,
            "here": here(request),
            **context,
        }
        # Rendering a big page takes a while: in the thread pool, not on the event loop.
        html = await run_in_threadpool(self.templates.get_template(template).render, variables)
        return HTMLResponse(html, status_code=status_code)

    async def error_page(self, request: Request, status_code: int, message: str) -> Response:
        return await self.page(
            request, "error.html", {"status": status_code, "message": message}, status_code
        )

    @staticmethod
    def flash(request: Request, level: str, text: str) -> None:
        flashes = request.session.setdefault("flash", [])
        flashes.append([level, text])

    # -- access --------------------------------------------------------------------------------

    def reader(self, handler: Handler) -> Handler:
        """A page: open on a loopback-only server, else for logged-in users."""

        async def guarded(request: Request) -> Response:
            if not self.auth.open_reads:
                user = await run_in_threadpool(self.auth.session_user, request)
                if user is None:
                    return RedirectResponse(
                        f"/login?{urlencode({'next': here(request)})}", status_code=303
                    )
            return await self._guarded_call(handler, request, api=False)

        return guarded

    def actor(self, handler: Handler) -> Handler:
        """A form action: a logged-in user and the session's CSRF token."""

        async def guarded(request: Request) -> Response:
            try:
                form = await checked_form(request)
            except BadInput as exc:
                return await self.error_page(request, 400, str(exc))
            if not self.auth.csrf_valid(request, form.get(CSRF_FIELD)):
                return await self.error_page(
                    request, 403, "the form is out of date (CSRF token missing or wrong): reload"
                )
            user = await run_in_threadpool(self.auth.session_user, request)
            if user is None:
                back = _safe_next(form.get("next"), _safe_next(request.headers.get("referer")))
                return RedirectResponse(f"/login?{urlencode({'next': back})}", status_code=303)
            request.scope["form"] = form
            request.scope["acting_user"] = user
            return await self._guarded_call(handler, request, api=False)

        return guarded

    def api_reader(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            if has_bearer(request):
                return no_token_here()
            if not self.auth.open_reads:
                refused = await self._api_refusal(request)
                if refused is not None:
                    return refused
            return await self._guarded_call(handler, request, api=True)

        return guarded

    def api_actor(
        self, handler: Handler, token_scope: str | None = None, *, rechecked: bool = False
    ) -> Handler:
        """An API write: HTTP Basic credentials, or a session cookie with its CSRF token in the
        X-CSRF-Token header, or where ``token_scope`` is given an API token with that scope; a
        JSON body (a form could not send one from another site). ``rechecked``: the write's own
        transaction finds the token's row still there (``tokens.checked_and_locking``, given the
        token's id in ``request.scope["token_id"]``), so a token verified before is taken from
        memory (``Auth.bearer``)."""

        async def guarded(request: Request) -> Response:
            if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                return api_error(415, "send a JSON body (Content-Type: application/json)")
            acting = await self._api_acting(request, token_scope, rechecked)
            if isinstance(acting, Response):
                return acting
            request.scope["acting_user"] = acting
            try:
                body = parse_json((await request.body()).decode(), "the body")
            except UnicodeDecodeError:
                return api_error(400, "the body is not UTF-8")
            except BadInput as exc:
                return api_error(400, str(exc))
            if not isinstance(body, dict):
                return api_error(400, "the body must be a JSON object")
            request.scope["body"] = body
            return await self._guarded_call(handler, request, api=True)

        return guarded

    def token_optional(self, handler: Handler, token_scope: str) -> Handler:
        """A path open without a login (its credential is in the URL) where a machine may also
        send an API token: if it does, the token must be valid and have ``token_scope``; the
        handler finds who it acts as in ``request.scope["token_acting"]`` (None without)."""

        async def guarded(request: Request) -> Response:
            request.scope["token_acting"] = None
            if has_bearer(request):
                acting = token_acting(await self.auth.bearer(request), token_scope)
                if isinstance(acting, Response):
                    return acting
                request.scope["token_acting"] = acting
            return await handler(request)

        return guarded

    async def _api_acting(
        self, request: Request, token_scope: str | None, rechecked: bool = False
    ) -> str | Response:
        """Who an API write acts as (a user's name, or ``token:<name>``), or why it is
        refused."""
        if has_bearer(request):
            if token_scope is None:
                return no_token_here()
            bearer = await self.auth.bearer(request, rechecked=rechecked)
            if bearer is not None and rechecked:
                request.scope["token_id"] = bearer.id
            return token_acting(bearer, token_scope)
        basic = await self.auth.basic_user(request)
        if basic is not None:
            return basic_refused(basic) if basic.identity is None else basic.identity.username
        acting = await run_in_threadpool(self.auth.session_user, request)
        if acting is None:
            return api_error(401, "login required (a session cookie or HTTP Basic auth)")
        if not self.auth.csrf_valid(request, request.headers.get(CSRF_HEADER)):
            return api_error(403, "CSRF token missing or wrong (X-CSRF-Token header)")
        return acting

    async def _api_refusal(self, request: Request) -> Response | None:
        """Why an API read is refused (None: a session or Basic credentials let it through)."""
        if await run_in_threadpool(self.auth.session_user, request) is not None:
            return None
        basic = await self.auth.basic_user(request)
        if basic is None:
            return api_error(401, "login required (a session cookie or HTTP Basic auth)")
        return None if basic.identity is not None else basic_refused(basic)

    async def _guarded_call(self, handler: Handler, request: Request, *, api: bool) -> Response:
        """Run ``handler``, turning what it refuses into the answer a user can read."""
        try:
            check_urlencoded(request.scope["query_string"], "the query string")
            if "dag_id" in request.path_params:
                check_id("dag_id", request.path_params["dag_id"])
            return await handler(request)
        except IdempotencyConflict as exc:
            if api:
                return api_error(409, str(exc))
            return await self.error_page(request, 409, str(exc))
        except (NotFound, BadInput, BadCursor, actions.ActionError) as exc:
            not_found = isinstance(exc, NotFound) or getattr(exc, "not_found", False)
            status = 404 if not_found else 400
            if api:
                return api_error(status, str(exc))
            return await self.error_page(request, status, str(exc))
        except Exception as exc:
            said = server_error(exc, self.settings)
            if said is None:
                log.exception("%s %s failed", request.method, request.url.path)
                message = "internal error (the webserver's log has the details)"
                return (
                    api_error(500, message) if api else await self.error_page(request, 500, message)
                )
            return api_error(503, said[0]) if api else await self.error_page(request, 503, said[0])

    # -- the application -------------------------------------------------------------------------

    def routes(self) -> list[Route | Mount]:
        reads, writes = Reads(self), Writes(self)
        return [
            *Pages(self, reads).routes(),
            *Forms(self, writes).routes(),
            *approvals.page_routes(self),
            *Api(self, reads, writes).routes(),
            *approvals.api_routes(self),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]

    def close(self) -> None:
        self.signal_batches.close()
        if self._broker is not None:
            self._broker.close()


def create_app(
    settings: Settings, *, host: str, environ: Mapping[str, str] | None = None
) -> Starlette:
    """The web UI for a server listening on ``host`` (read-only pages need no login when that
    is a loopback address)."""
    environ = environ if environ is not None else os.environ
    web = webserver_settings(environ)
    ui = WebUI(settings, web, host=host, environ=environ)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if request.url.path.startswith(f"{API}/"):
            return api_error(status, "no such API path" if status == 404 else str(exc))
        return await ui.error_page(request, status, "no such page" if status == 404 else str(exc))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        ui.close()

    routes = ui.routes()
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(RequestMetrics, routes=routes),
            Middleware(
                HostCheck,
                bind=host,
                loopback_bind=is_loopback(host),
                allowed_hosts=web.allowed_hosts,
            ),
            # Before the browser's layers: a machine's token requests skip them.
            Middleware(
                MachinePath,
                routes=[r for r in routes if isinstance(r, Route) and r.path in TOKEN_PATHS],
            ),
            Middleware(SecurityHeaders),
            Middleware(
                SessionMiddleware,
                secret_key=session_key(settings).hex(),
                session_cookie=SESSION_COOKIE,
                max_age=int(web.session_lifetime.total_seconds()),
                same_site="lax",
                https_only=web.secure_cookies,
            ),
        ],
        exception_handlers={HTTPException: not_found},
        lifespan=lifespan,
        max_body_size=MAX_BODY_BYTES,
    )
    app.state.ui = ui
    return app
