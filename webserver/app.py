"""The ASGI application: pages (Jinja2, autoescaped), the JSON API under ``/api/v1/``, and the
user actions, which take the ``deferral`` command's own paths (``deferral.store.actions``).

Database and Redis calls are blocking, so they run in Starlette's thread pool; one DagBag per
process serves the DAGs (``readmodel.dags.DagSource``).
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
from urllib.parse import quote, urlencode

import jinja2
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import deadletters
from broker.client import Broker
from broker.streams import WAKE
from deferral import signals
from deferral.runtime import controls, secrets_masker, storable
from deferral.runtime.config import Settings, WebserverSettings, webserver_settings
from deferral.runtime.crypto import Cipher
from deferral.store import actions
from deferral.store.callback_tokens import Claim, TokenRefused, read_token
from deferral.store.db import make_engine, make_sessionmaker
from readmodel import dags, processes, streams, tasks, waits
from readmodel.doctor import doctor_record
from readmodel.errors import NotFound, server_error
from readmodel.pages import BadCursor
from readmodel.records import json_value
from webserver import approvals, data, paramform, users
from webserver.access_log import CALLBACK_PATH
from webserver.auth import (
    CSRF_FIELD,
    CSRF_HEADER,
    SESSION_COOKIE,
    Auth,
    Verdict,
    client_of,
    is_loopback,
    session_key,
)
from webserver.hosts import HostCheck
from webserver.inputs import (
    MAX_INT64,
    MAX_JSON_DEPTH,
    BadInput,
    check_id,
    check_urlencoded,
    int_param,
    json_depth,
    parse_json,
)
from webserver.ratelimits import RUNS, SIGNALS, Refusal, WriteLimits
from webserver.requestmetrics import RequestMetrics

log = logging.getLogger("deferral.webserver")

HERE = Path(__file__).resolve().parent
API = "/api/v1"
# A form or an API body larger than this is refused (a run's conf is small).
MAX_BODY_BYTES = 1024 * 1024
# The header the page script's live refresh sends.
LIVE_HEADER = "x-deferral-live"
# Every page refreshes its live parts this often (milliseconds), while it is visible.
REFRESH_MS = 2000

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


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every response (and ``no-store`` to pages and API answers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                extra = dict(SECURITY_HEADERS)
                if not static:
                    extra["cache-control"] = "no-store"
                headers += [(k.encode(), v.encode()) for k, v in extra.items()]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


# -- formatting helpers for the templates --------------------------------------------------------


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return "-"
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


def dag_url(dag_id: str, **query: Any) -> str:
    url = f"/dags/{quote(dag_id, safe='')}"
    given = {key: value for key, value in query.items() if value is not None}
    return f"{url}?{urlencode(given)}" if given else url


def _ti_query(run_id: str, task_id: str, map_index: int | None, try_number: int | None) -> str:
    query: dict[str, Any] = {"run_id": run_id, "task_id": task_id}
    if map_index is not None and map_index >= 0:
        query["map_index"] = map_index
    if try_number is not None:
        query["try_number"] = try_number
    return urlencode(query)


def ti_url(
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int | None = None,
    try_number: int | None = None,
) -> str:
    """The page of a task instance (showing the log of ``try_number``)."""
    query = _ti_query(run_id, task_id, map_index, try_number)
    return f"/dags/{quote(dag_id, safe='')}/task_instance?{query}"


def log_url(dag_id: str, run_id: str, task_id: str, map_index: int, try_number: int) -> str:
    """The API answer with the lines of one try's log."""
    query = _ti_query(run_id, task_id, map_index, try_number)
    return f"{API}/dags/{quote(dag_id, safe='')}/task_instance/log?{query}"


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


def _safe_next(target: object, default: str = "/dags") -> str:
    """A same-site path to go back to (never another site: ``//host`` or a scheme)."""
    if isinstance(target, str) and target.startswith("/") and not target.startswith(("//", "/\\")):
        return target
    return default


def _required(params: Mapping[str, Any], name: str) -> str:
    """The id ``name`` of a query, form or body (checked: no control characters, not too
    long)."""
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise BadInput(f"{name} is required")
    return check_id(name, value)


def _optional_id(params: Mapping[str, Any], name: str) -> str | None:
    value = params.get(name)
    return check_id(name, value) if isinstance(value, str) and value else None


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
        self.dags = dags.DagSource(settings.dags_folder)
        self.auth = Auth(
            self.sessions,
            session_key(settings),
            # Allowed host names mean a proxy in front: others than this machine connect.
            open_reads=is_loopback(host) and not web.allowed_hosts,
            session_lifetime=web.session_lifetime,
            environ=environ,
        )
        self.templates = _templates()
        self.web = web
        self.limits = WriteLimits(web)
        self._broker: Broker | None = None
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
            "here": _here(request),
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
                        f"/login?{urlencode({'next': _here(request)})}", status_code=303
                    )
            return await self._guarded_call(handler, request, api=False)

        return guarded

    def actor(self, handler: Handler) -> Handler:
        """A form action: a logged-in user and the session's CSRF token."""

        async def guarded(request: Request) -> Response:
            try:
                form = await _checked_form(request)
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
            if not self.auth.open_reads:
                refused = await self._api_refusal(request)
                if refused is not None:
                    return refused
            return await self._guarded_call(handler, request, api=True)

        return guarded

    def api_actor(self, handler: Handler) -> Handler:
        """An API write: HTTP Basic credentials, or a session cookie with its CSRF token in the
        X-CSRF-Token header; a JSON body (a form could not send one from another site)."""

        async def guarded(request: Request) -> Response:
            if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                return _api_error(415, "send a JSON body (Content-Type: application/json)")
            basic = await self.auth.basic_user(request)
            if basic is not None and basic.identity is None:
                return _basic_refused(basic)
            if basic is None:
                acting = await run_in_threadpool(self.auth.session_user, request)
                if acting is None:
                    return _api_error(401, "login required (a session cookie or HTTP Basic auth)")
                if not self.auth.csrf_valid(request, request.headers.get(CSRF_HEADER)):
                    return _api_error(403, "CSRF token missing or wrong (X-CSRF-Token header)")
            else:
                assert basic.identity is not None
                acting = basic.identity.username
            request.scope["acting_user"] = acting
            try:
                body = parse_json((await request.body()).decode(), "the body")
            except UnicodeDecodeError:
                return _api_error(400, "the body is not UTF-8")
            except BadInput as exc:
                return _api_error(400, str(exc))
            if not isinstance(body, dict):
                return _api_error(400, "the body must be a JSON object")
            request.scope["body"] = body
            return await self._guarded_call(handler, request, api=True)

        return guarded

    async def _api_refusal(self, request: Request) -> Response | None:
        """Why an API read is refused (None: a session or Basic credentials let it through)."""
        if await run_in_threadpool(self.auth.session_user, request) is not None:
            return None
        basic = await self.auth.basic_user(request)
        if basic is None:
            return _api_error(401, "login required (a session cookie or HTTP Basic auth)")
        return None if basic.identity is not None else _basic_refused(basic)

    async def _guarded_call(self, handler: Handler, request: Request, *, api: bool) -> Response:
        """Run ``handler``, turning what it refuses into the answer a user can read."""
        try:
            check_urlencoded(request.scope["query_string"], "the query string")
            if "dag_id" in request.path_params:
                check_id("dag_id", request.path_params["dag_id"])
            return await handler(request)
        except (NotFound, BadInput, BadCursor, actions.ActionError) as exc:
            not_found = isinstance(exc, NotFound) or getattr(exc, "not_found", False)
            status = 404 if not_found else 400
            if api:
                return _api_error(status, str(exc))
            return await self.error_page(request, status, str(exc))
        except Exception as exc:
            said = server_error(exc, self.settings)
            if said is None:
                log.exception("%s %s failed", request.method, request.url.path)
                message = "internal error (the webserver's log has the details)"
                return (
                    _api_error(500, message)
                    if api
                    else await self.error_page(request, 500, message)
                )
            return _api_error(503, said[0]) if api else await self.error_page(request, 503, said[0])

    # -- pages ---------------------------------------------------------------------------------

    async def dags_page(self, request: Request) -> Response:
        overview = await run_in_threadpool(self._dags_overview, request)
        return await self.page(request, "dags.html", overview)

    def _dags_overview(self, request: Request) -> dict[str, Any]:
        tags = data.wanted_tags(request.query_params.getlist("tags"))
        search = request.query_params.get("search", "")[: data.MAX_SEARCH_LENGTH]
        return self._read(dags.dags_overview, self.dags, tags, search)

    def _read(self, read: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        with self.sessions() as session:
            return read(session, *args)

    def _dag_detail(self, request: Request) -> dict[str, Any]:
        dag_id = request.path_params["dag_id"]
        runs = int_param(request.query_params.get("runs"), "runs", low=1, high=data.MAX_GRID_RUNS)
        return self._read(
            data.dag_page,
            self.dags,
            dag_id,
            runs or data.GRID_RUNS,
            _optional_id(request.query_params, "run_id"),
            int_param(request.query_params.get("task_page"), "task_page", low=1) or 1,
            [check_id("collapse", group) for group in request.query_params.getlist("collapse")],
        )

    async def dag_page(self, request: Request) -> Response:
        detail = await run_in_threadpool(self._dag_detail, request)
        return await self.page(request, "dag.html", detail)

    def _task_instance(self, request: Request) -> dict[str, Any]:
        query = request.query_params
        return self._read(
            tasks.task_instance_detail,
            self.settings,
            self.dags,
            request.path_params["dag_id"],
            _required(query, "run_id"),
            _required(query, "task_id"),
            int_param(query.get("map_index"), "map_index", low=-1),
            int_param(query.get("try_number"), "try_number", low=1),
        )

    def _task_log(self, request: Request) -> dict[str, Any]:
        query = request.query_params
        try_number = int_param(_required(query, "try_number"), "try_number", low=1)
        return self._read(
            tasks.task_log,
            request.path_params["dag_id"],
            _required(query, "run_id"),
            _required(query, "task_id"),
            int_param(query.get("map_index"), "map_index", low=-1) or -1,
            try_number,
            int_param(query.get("after_id"), "after_id", low=0, high=MAX_INT64) or 0,
            int_param(query.get("limit"), "limit", low=1, high=tasks.LOG_LINES_SHOWN)
            or tasks.LOG_LINES_SHOWN,
        )

    async def task_page(self, request: Request) -> Response:
        detail = await run_in_threadpool(self._task_instance, request)
        return await self.page(
            request, "task.html", {**detail, "markable": [str(s) for s in actions.MARKABLE_STATES]}
        )

    def _deferred(self, request: Request) -> dict[str, Any]:
        """A page of the deferred tasks: ``?limit=`` of them from just after ``?after=``."""
        query = request.query_params
        limit = int_param(query.get("limit"), "limit", low=1, high=waits.MAX_DEFERRED_PAGE)
        with self.sessions() as session:
            return waits.deferred_now(
                session,
                self.settings,
                limit=limit or waits.DEFERRED_PAGE,
                after=query.get("after") or None,
            )

    async def deferred_page(self, request: Request) -> Response:
        found = await run_in_threadpool(self._deferred, request)
        return await self.page(request, "deferred.html", found)

    async def triggerers_page(self, request: Request) -> Response:
        found = await run_in_threadpool(self._read, processes.processes, self.settings)
        return await self.page(request, "triggerers.html", found)

    def _streams(self) -> dict[str, Any]:
        return streams.streams_overview(self.broker(), Cipher(self.settings.fernet_keys))

    async def streams_page(self, request: Request) -> Response:
        found = await run_in_threadpool(
            lambda: streams.streams_overview(self.broker(), Cipher(self.settings.fernet_keys))
        )
        return await self.page(request, "streams.html", found)

    async def doctor_page(self, request: Request) -> Response:
        found = await run_in_threadpool(doctor_record, self.settings)
        return await self.page(request, "doctor.html", found)

    # -- login -----------------------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        next_url = _safe_next(request.query_params.get("next"))
        return await self.page(
            request, "login.html", {"next": next_url, "refused": False, "retry_after": 0}
        )

    async def login(self, request: Request) -> Response:
        try:
            form = await _checked_form(request)
        except BadInput as exc:
            return await self.error_page(request, 400, str(exc))
        next_url = _safe_next(form.get("next"))
        if not self.auth.csrf_valid(request, form.get(CSRF_FIELD)):
            return await self.error_page(
                request, 403, "the form is out of date (CSRF token missing or wrong): reload"
            )
        username, password = form.get("username"), form.get("password")
        if not isinstance(username, str) or not isinstance(password, str):
            return await self.error_page(request, 400, "the form needs a username and a password")
        verdict = await self.auth.verify(client_of(request), username, password, "login form")
        if verdict.identity is None:
            context = {"next": next_url, "refused": True, "retry_after": verdict.retry_after_sec}
            answer = await self.page(
                request, "login.html", context, status_code=429 if verdict.retry_after_sec else 401
            )
            return _with_retry_after(answer, verdict)
        await run_in_threadpool(self.auth.start_session, request, verdict.identity)
        log.info("%s logged in", verdict.identity.username)
        return RedirectResponse(next_url, status_code=303)

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if self.auth.csrf_valid(request, form.get(CSRF_FIELD)):
            await run_in_threadpool(self.auth.log_out, request)
        return RedirectResponse("/dags", status_code=303)

    # -- actions (forms) -------------------------------------------------------------------------

    def _dag(self, dag_id: str) -> Any:
        dag = self.dags.dag(dag_id)
        if dag is None:
            raise actions.ActionError(
                f"DAG {dag_id!r} not found in {self.settings.dags_folder}", not_found=True
            )
        return dag

    def _trigger(
        self,
        dag_id: str,
        conf_text: str | None,
        run_id: str | None,
        form: Mapping[str, Any] | None = None,
    ) -> actions.Triggered:
        """Trigger a run with ``conf_text``'s conf; with the trigger page's ``form``, what its
        param fields give first (the conf text's keys win)."""
        if run_id:
            check_id("run_id", run_id)
        if conf_text and json_depth(conf_text) > MAX_JSON_DEPTH:
            raise BadInput(f"conf nests deeper than {MAX_JSON_DEPTH} levels")
        try:
            conf = actions.parse_conf(conf_text)
        except ValueError as exc:
            raise BadInput(f"conf: {exc}") from None
        dag = self._dag(dag_id)
        if form is not None:
            conf = {
                **paramform.conf_from_form(paramform.fields(dag.params, dag.param_specs), form),
                **conf,
            }
        return actions.trigger_run(self.sessions, dag, conf, run_id or None)

    def _set_paused(self, dag_id: str, paused: bool) -> None:
        actions.set_paused(self.sessions, self._dag(dag_id), paused)

    def _change(
        self, dag_id: str, params: Mapping[str, Any], change: actions.Change
    ) -> actions.UserChanges:
        map_indexes = params.get("map_indexes", ())
        if not isinstance(map_indexes, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in map_indexes
        ):
            raise BadInput("map_indexes must be a list of integers")
        # A task maps into at most max_map_length instances, numbered from 0.
        most = self.settings.max_map_length
        if len(map_indexes) > most or not all(0 <= i < most for i in map_indexes):
            raise BadInput(f"map_indexes must be at most {most} integers from 0 to {most - 1}")
        return actions.change_tasks(
            self.sessions,
            self._dag(dag_id),
            _required(params, "run_id"),
            _required(params, "task_id"),
            change,
            downstream=bool(params.get("downstream")),
            map_indexes=map_indexes,
            find_dag=self._dag,
        )

    async def trigger_form(self, request: Request) -> Response:
        form = request.scope["form"]
        dag_id = request.path_params["dag_id"]
        refused = self.limits.take(RUNS, f"user:{request.scope['acting_user']}")
        if refused is not None:
            page = await self.error_page(request, 429, _refusal_line(refused))
            return _retry_after(page, refused.retry_after_sec)
        conf, run_id = form.get("conf"), form.get("run_id")
        try:
            triggered = await run_in_threadpool(
                self._trigger,
                dag_id,
                conf if isinstance(conf, str) else None,
                run_id if isinstance(run_id, str) else None,
                form,
            )
        except (BadInput, actions.ActionError) as exc:
            self.flash(request, "error", str(exc))
            return RedirectResponse(dag_url(dag_id), status_code=303)
        log.info("%s triggered %s %s", self.auth.session_user(request), dag_id, triggered.run_id)
        self.flash(request, "ok", f"triggered {dag_id} {triggered.run_id}")
        if triggered.paused:
            self.flash(request, "warn", f"DAG {dag_id} is paused: the run waits until unpaused")
        return RedirectResponse(dag_url(dag_id, run_id=triggered.run_id), status_code=303)

    def pause_form(self, paused: bool) -> Handler:
        async def handler(request: Request) -> Response:
            dag_id = request.path_params["dag_id"]
            await run_in_threadpool(self._set_paused, dag_id, paused)
            user = self.auth.session_user(request)
            log.info("%s %s %s", user, "paused" if paused else "unpaused", dag_id)
            self.flash(request, "ok", f"DAG {dag_id} {'paused' if paused else 'unpaused'}")
            return RedirectResponse(
                _safe_next(request.scope["form"].get("next"), dag_url(dag_id)), status_code=303
            )

        return handler

    async def change_form(self, request: Request) -> Response:
        """Clear or mark a task instance (and, if asked, its downstream tasks)."""
        form = request.scope["form"]
        dag_id = request.path_params["dag_id"]
        what = form.get("action")
        change: actions.Change
        if what == "clear":
            change = actions.clear_change
        else:
            state = form.get("state")
            change = actions.mark_change(state if isinstance(state, str) else "")
        map_index = int_param(_text(form.get("map_index")), "map_index", low=-1)
        params = {
            "run_id": form.get("run_id"),
            "task_id": form.get("task_id"),
            "downstream": form.get("downstream") == "on",
            "map_indexes": [map_index] if map_index is not None and map_index >= 0 else [],
        }
        back = ti_url(dag_id, _text(form.get("run_id")), _text(form.get("task_id")), map_index)
        try:
            done = await run_in_threadpool(self._change, dag_id, params, change)
        except (BadInput, actions.ActionError) as exc:
            self.flash(request, "error", str(exc))
            return RedirectResponse(back, status_code=303)
        user = self.auth.session_user(request)
        log.info("%s: %s %s %s", user, what, dag_id, done.changed)
        if done.changed:
            said = ", ".join(f"{label}: {state}" for label, state in done.changed)
            self.flash(request, "ok", said)
        if done.refused:
            self.flash(
                request, "error", f"not changed while queued or running: {', '.join(done.refused)}"
            )
        return RedirectResponse(back, status_code=303)

    async def dead_letter_form(self, request: Request) -> Response:
        """Retry or drop one dead letter (the paths of `deferral dead retry|drop`)."""
        form = request.scope["form"]
        what, dead_id = _text(form.get("action")), _text(form.get("dead_id"))
        if what not in ("retry", "drop"):
            raise BadInput("action must be retry or drop")
        if not deadletters.valid_dead_id(dead_id):
            raise BadInput(f"{dead_id[:40]!r} is not a dead letter id")
        broker = self.broker()
        if what == "retry":
            cipher = Cipher(self.settings.fernet_keys)
            done = await run_in_threadpool(
                deadletters.retry, broker, self.sessions, cipher, dead_id
            )
            ok = done.outcome == deadletters.Outcome.RETRIED
            said = (
                f"retried {dead_id}: now {done.detail}"
                if ok
                else f"{dead_id} not retried: {done.detail}"
            )
        else:
            dropped = await run_in_threadpool(deadletters.drop, broker, [dead_id])
            ok = dropped[dead_id]
            said = f"dropped {dead_id}" if ok else f"no dead letter {dead_id}"
        log.info("%s: %s", self.auth.session_user(request), said)
        self.flash(request, "ok" if ok else "error", said)
        return RedirectResponse("/streams", status_code=303)

    # -- API -------------------------------------------------------------------------------------

    async def api_health(self, request: Request) -> Response:
        return _api({"status": "ok"})

    async def api_dags(self, request: Request) -> Response:
        return _api(await run_in_threadpool(self._dags_overview, request))

    async def api_dag(self, request: Request) -> Response:
        return _api(await run_in_threadpool(self._dag_detail, request))

    async def api_task_instance(self, request: Request) -> Response:
        return _api(await run_in_threadpool(self._task_instance, request))

    async def api_task_log(self, request: Request) -> Response:
        return _api(await run_in_threadpool(self._task_log, request))

    async def api_deferred(self, request: Request) -> Response:
        return _api(await run_in_threadpool(self._deferred, request))

    async def api_triggerers(self, request: Request) -> Response:
        return _api(await run_in_threadpool(self._read, processes.processes, self.settings))

    async def api_streams(self, request: Request) -> Response:
        return _api(
            await run_in_threadpool(
                lambda: streams.streams_overview(self.broker(), Cipher(self.settings.fernet_keys))
            )
        )

    async def api_doctor(self, request: Request) -> Response:
        return _api(await run_in_threadpool(doctor_record, self.settings))

    async def api_trigger(self, request: Request) -> Response:
        body = request.scope["body"]
        conf = body.get("conf", {})
        run_id = body.get("run_id")
        if not isinstance(conf, dict):
            raise BadInput("conf must be a JSON object")
        if run_id is not None and not isinstance(run_id, str):
            raise BadInput("run_id must be a string")
        refused = self.limits.take(RUNS, f"user:{request.scope['acting_user']}")
        if refused is not None:
            return _too_many(refused)
        dag_id = request.path_params["dag_id"]
        triggered = await run_in_threadpool(self._trigger, dag_id, json.dumps(conf), run_id)
        return _api(
            {"dag_id": dag_id, "run_id": triggered.run_id, "paused": triggered.paused},
            status_code=201,
        )

    def api_pause(self, paused: bool) -> Handler:
        async def handler(request: Request) -> Response:
            dag_id = request.path_params["dag_id"]
            await run_in_threadpool(self._set_paused, dag_id, paused)
            return _api({"dag_id": dag_id, "is_paused": paused})

        return handler

    async def api_clear(self, request: Request) -> Response:
        return await self._api_change(request, actions.clear_change)

    async def api_mark(self, request: Request) -> Response:
        state = request.scope["body"].get("state")
        return await self._api_change(
            request, actions.mark_change(state if isinstance(state, str) else repr(state))
        )

    async def _api_change(self, request: Request, change: actions.Change) -> Response:
        dag_id = request.path_params["dag_id"]
        done = await run_in_threadpool(self._change, dag_id, request.scope["body"], change)
        return _api(
            {
                "changed": [{"task": label, "state": state} for label, state in done.changed],
                "refused": done.refused,
            },
            status_code=409 if done.refused else 200,
        )

    async def api_signal(self, request: Request) -> Response:
        payload = request.scope["body"].get("payload")
        acting = request.scope["acting_user"]
        refused = self.limits.take(SIGNALS, f"user:{acting}")
        if refused is not None:
            return _too_many(refused)
        sender = signals.Sender(acting, self.web.signals_kept_per_user)
        sent = await run_in_threadpool(
            self._send_signal, request.path_params["key"], payload, sender
        )
        return _api(
            {"signal_id": sent.id, "key": sent.key, "resumed": len(sent.resumed)}, status_code=201
        )

    def _send_signal(self, key: str, payload: Any, sender: signals.Sender) -> signals.SentSignal:
        try:
            with self.sessions.begin() as session:
                cipher = Cipher(self.settings.fernet_keys)
                sent = signals.send_in(session, cipher, key, payload, sender)
        except signals.SignalError as exc:
            raise BadInput(str(exc)) from None
        if sent.resumed:  # the scheduler queues them now, not when its wait for events ends
            self.broker().publish(self.broker().keys.events, WAKE)
        return sent

    async def api_callback(self, request: Request) -> Response:
        """A task's callback: no login (the token is the credential), a JSON body
        ``{"status": "success"|"failure", "payload": ...}``."""
        body = await request.body()
        try:
            answer = parse_json(body.decode(), "the body")
        except (UnicodeDecodeError, BadInput) as exc:
            return _api_error(
                400, str(exc) if isinstance(exc, BadInput) else "the body is not UTF-8"
            )
        if not isinstance(answer, dict):
            return _api_error(400, "the body must be a JSON object")
        cipher = Cipher(self.settings.fernet_keys)
        try:
            claim = read_token(cipher, request.path_params["token"], dt.datetime.now(dt.UTC))
            refused = self.limits.take(SIGNALS, f"token:{claim.key}")
            if refused is not None:
                return _too_many(refused)
            sent = await run_in_threadpool(
                self._answer_callback, cipher, claim, answer.get("status"), answer.get("payload")
            )
        except TokenRefused as exc:
            return _api_error(exc.status, str(exc))
        return _api({"resumed": len(sent.resumed)})

    def _answer_callback(
        self, cipher: Cipher, claim: Claim, status: Any, payload: Any
    ) -> signals.SentSignal:
        with self.sessions.begin() as session:
            sent = signals.answer_callback(session, cipher, claim, status, payload)
        if sent.resumed:
            self.broker().publish(self.broker().keys.events, WAKE)
        return sent

    # -- the application -------------------------------------------------------------------------

    def routes(self) -> list[Route | Mount]:
        r, a = self.reader, self.actor
        return [
            Route("/", lambda request: RedirectResponse("/dags", status_code=307)),
            Route("/dags", r(self.dags_page)),
            Route("/dags/{dag_id}", r(self.dag_page)),
            Route("/dags/{dag_id}/task_instance", r(self.task_page)),
            Route("/deferred", r(self.deferred_page)),
            Route("/triggerers", r(self.triggerers_page)),
            Route("/streams", r(self.streams_page)),
            Route("/doctor", r(self.doctor_page)),
            Route("/login", self.login_page, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/dags/{dag_id}/trigger", a(self.trigger_form), methods=["POST"]),
            Route("/dags/{dag_id}/pause", a(self.pause_form(True)), methods=["POST"]),
            Route("/dags/{dag_id}/unpause", a(self.pause_form(False)), methods=["POST"]),
            Route("/dags/{dag_id}/change", a(self.change_form), methods=["POST"]),
            Route("/streams/dead", a(self.dead_letter_form), methods=["POST"]),
            *approvals.page_routes(self),
            *self.api_routes(),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]

    def api_routes(self) -> list[Route]:
        r, a = self.api_reader, self.api_actor
        return [
            Route(f"{API}/health", self.api_health),
            Route(f"{API}/dags", r(self.api_dags)),
            Route(f"{API}/dags/{{dag_id}}", r(self.api_dag)),
            Route(f"{API}/dags/{{dag_id}}/task_instance", r(self.api_task_instance)),
            Route(f"{API}/dags/{{dag_id}}/task_instance/log", r(self.api_task_log)),
            Route(f"{API}/deferred", r(self.api_deferred)),
            Route(f"{API}/triggerers", r(self.api_triggerers)),
            Route(f"{API}/streams", r(self.api_streams)),
            Route(f"{API}/doctor", r(self.api_doctor)),
            Route(f"{API}/dags/{{dag_id}}/runs", a(self.api_trigger), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/pause", a(self.api_pause(True)), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/unpause", a(self.api_pause(False)), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/clear", a(self.api_clear), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/mark", a(self.api_mark), methods=["POST"]),
            Route(f"{API}/signals/{{key}}", a(self.api_signal), methods=["POST"]),
            Route(f"{CALLBACK_PATH}{{token}}", self.api_callback, methods=["POST"]),
            *approvals.api_routes(self),
        ]

    def close(self) -> None:
        if self._broker is not None:
            self._broker.close()


async def _checked_form(request: Request) -> FormData:
    """The request's form, refused (BadInput) if a field is not UTF-8 or holds a NUL or a lone
    surrogate."""
    if request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        check_urlencoded(await request.body(), "the form")
    form = await request.form()
    for name, value in form.multi_items():
        if isinstance(value, str):
            try:
                storable.check(value, f"the form's {controls.escape_all(name[:64])}")
            except storable.UnstorableText as exc:
                raise BadInput(str(exc)) from None
    return form


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _here(request: Request) -> str:
    query = request.url.query
    return f"{request.url.path}?{query}" if query else request.url.path


def _api(payload: Any, status_code: int = 200) -> Response:
    body = json.dumps(data.json_ready(payload), default=json_value)
    return Response(body, status_code=status_code, media_type="application/json")


def _api_error(status_code: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status_code)


def _with_retry_after(response: Response, verdict: Verdict) -> Response:
    if verdict.retry_after_sec > 0:
        return _retry_after(response, max(1, round(verdict.retry_after_sec)))
    return response


def _retry_after(response: Response, seconds: int) -> Response:
    response.headers["retry-after"] = str(seconds)
    return response


def _refusal_line(refused: Refusal) -> str:
    return f"{refused.message}; try again in {refused.retry_after_sec} s"


def _too_many(refused: Refusal) -> Response:
    return _retry_after(_api_error(429, _refusal_line(refused)), refused.retry_after_sec)


def _basic_refused(verdict: Verdict) -> Response:
    if verdict.retry_after_sec > 0:
        seconds = max(1, round(verdict.retry_after_sec))
        refused = _api_error(429, f"too many failed logins: try again in {seconds} s")
        return _with_retry_after(refused, verdict)
    return _api_error(401, "wrong user name or password")


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
            return _api_error(status, "no such API path" if status == 404 else str(exc))
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
