"""The web UI's pages (each renders what `reads` reads) and the login and logout that let a user
act."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from deferral.store import actions
from webserver.answers import with_retry_after
from webserver.auth import CSRF_FIELD, client_of
from webserver.forms import checked_form
from webserver.inputs import BadInput
from webserver.reads import Reads
from webserver.urls import safe_next

if TYPE_CHECKING:
    from webserver.app import Handler, WebUI

log = logging.getLogger("deferral.webserver")


class Pages:
    def __init__(self, ui: WebUI, reads: Reads) -> None:
        self.ui = ui
        self.reads = reads

    def rendering(self, read: Callable[[Request], Mapping[str, Any]], template: str) -> Handler:
        """A page: ``read``'s record (in the thread pool), rendered by ``template``."""

        async def handler(request: Request) -> Response:
            found = await run_in_threadpool(read, request)
            return await self.ui.page(request, template, dict(found))

        return handler

    def _task_detail(self, request: Request) -> dict[str, Any]:
        """A task instance, and the states the page's form may mark it with."""
        markable = [str(s) for s in actions.MARKABLE_STATES]
        return {**self.reads.task_instance(request), "markable": markable}

    # -- login -----------------------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        next_url = safe_next(request.query_params.get("next"))
        return await self.ui.page(
            request, "login.html", {"next": next_url, "refused": False, "retry_after": 0}
        )

    async def login(self, request: Request) -> Response:
        ui = self.ui
        try:
            form = await checked_form(request)
        except BadInput as exc:
            return await ui.error_page(request, 400, str(exc))
        next_url = safe_next(form.get("next"))
        if not ui.auth.csrf_valid(request, form.get(CSRF_FIELD)):
            return await ui.error_page(
                request, 403, "the form is out of date (CSRF token missing or wrong): reload"
            )
        username, password = form.get("username"), form.get("password")
        if not isinstance(username, str) or not isinstance(password, str):
            return await ui.error_page(request, 400, "the form needs a username and a password")
        verdict = await ui.auth.verify(client_of(request), username, password, "login form")
        if verdict.identity is None:
            context = {"next": next_url, "refused": True, "retry_after": verdict.retry_after_sec}
            answer = await ui.page(
                request, "login.html", context, status_code=429 if verdict.retry_after_sec else 401
            )
            return with_retry_after(answer, verdict)
        await run_in_threadpool(ui.auth.start_session, request, verdict.identity)
        log.info("%s logged in", verdict.identity.username)
        return RedirectResponse(next_url, status_code=303)

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if self.ui.auth.csrf_valid(request, form.get(CSRF_FIELD)):
            await run_in_threadpool(self.ui.auth.log_out, request)
        return RedirectResponse("/dags", status_code=303)

    def routes(self) -> list[Route]:
        r, show, reads = self.ui.reader, self.rendering, self.reads
        return [
            Route("/", lambda request: RedirectResponse("/dags", status_code=307)),
            Route("/dags", r(show(reads.dags_overview, "dags.html"))),
            Route("/dags/{dag_id}", r(show(reads.dag_detail, "dag.html"))),
            Route("/dags/{dag_id}/task_instance", r(show(self._task_detail, "task.html"))),
            Route("/deferred", r(show(reads.deferred, "deferred.html"))),
            Route("/triggerers", r(show(reads.processes, "triggerers.html"))),
            Route("/streams", r(show(reads.streams, "streams.html"))),
            Route("/doctor", r(show(reads.doctor, "doctor.html"))),
            Route("/login", self.login_page, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
        ]
