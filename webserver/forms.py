"""The web UI's forms: trigger a run, pause or unpause a DAG, clear or mark a task instance,
retry or drop a dead letter; each answers with a redirect and a message for the next page."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from broker import deadletters
from deferral.runtime import controls, storable
from deferral.runtime.crypto import Cipher
from deferral.store import actions
from webserver.answers import refusal_line, retry_after
from webserver.inputs import BadInput, check_urlencoded, int_param
from webserver.ratelimits import RUNS
from webserver.urls import dag_url, safe_next, ti_url
from webserver.writes import Writes

if TYPE_CHECKING:
    from webserver.app import Handler, WebUI

log = logging.getLogger("deferral.webserver")


async def checked_form(request: Request) -> FormData:
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


class Forms:
    def __init__(self, ui: WebUI, writes: Writes) -> None:
        self.ui = ui
        self.writes = writes

    async def trigger_form(self, request: Request) -> Response:
        ui = self.ui
        form = request.scope["form"]
        dag_id = request.path_params["dag_id"]
        refused = ui.limits.take(RUNS, f"user:{request.scope['acting_user']}")
        if refused is not None:
            page = await ui.error_page(request, 429, refusal_line(refused))
            return retry_after(page, refused.retry_after_sec)
        conf, run_id = form.get("conf"), form.get("run_id")
        try:
            triggered = await run_in_threadpool(
                self.writes.trigger,
                dag_id,
                conf if isinstance(conf, str) else None,
                run_id if isinstance(run_id, str) else None,
                form,
            )
        except (BadInput, actions.ActionError) as exc:
            ui.flash(request, "error", str(exc))
            return RedirectResponse(dag_url(dag_id), status_code=303)
        log.info("%s triggered %s %s", ui.auth.session_user(request), dag_id, triggered.run_id)
        ui.flash(request, "ok", f"triggered {dag_id} {triggered.run_id}")
        if triggered.paused:
            ui.flash(request, "warn", f"DAG {dag_id} is paused: the run waits until unpaused")
        return RedirectResponse(dag_url(dag_id, run_id=triggered.run_id), status_code=303)

    def pause_form(self, paused: bool) -> Handler:
        async def handler(request: Request) -> Response:
            dag_id = request.path_params["dag_id"]
            await run_in_threadpool(self.writes.set_paused, dag_id, paused)
            user = self.ui.auth.session_user(request)
            log.info("%s %s %s", user, "paused" if paused else "unpaused", dag_id)
            self.ui.flash(request, "ok", f"DAG {dag_id} {'paused' if paused else 'unpaused'}")
            return RedirectResponse(
                safe_next(request.scope["form"].get("next"), dag_url(dag_id)), status_code=303
            )

        return handler

    async def change_form(self, request: Request) -> Response:
        """Clear or mark a task instance (and, if asked, its downstream tasks)."""
        ui = self.ui
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
            done = await run_in_threadpool(self.writes.change, dag_id, params, change)
        except (BadInput, actions.ActionError) as exc:
            ui.flash(request, "error", str(exc))
            return RedirectResponse(back, status_code=303)
        user = ui.auth.session_user(request)
        log.info("%s: %s %s %s", user, what, dag_id, done.changed)
        if done.changed:
            said = ", ".join(f"{label}: {state}" for label, state in done.changed)
            ui.flash(request, "ok", said)
        if done.refused:
            ui.flash(
                request, "error", f"not changed while queued or running: {', '.join(done.refused)}"
            )
        return RedirectResponse(back, status_code=303)

    async def dead_letter_form(self, request: Request) -> Response:
        """Retry or drop one dead letter (the paths of `deferral dead retry|drop`)."""
        ui = self.ui
        form = request.scope["form"]
        what, dead_id = _text(form.get("action")), _text(form.get("dead_id"))
        if what not in ("retry", "drop"):
            raise BadInput("action must be retry or drop")
        if not deadletters.valid_dead_id(dead_id):
            raise BadInput(f"{dead_id[:40]!r} is not a dead letter id")
        broker = ui.broker()
        if what == "retry":
            cipher = Cipher(ui.settings.fernet_keys)
            done = await run_in_threadpool(deadletters.retry, broker, ui.sessions, cipher, dead_id)
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
        log.info("%s: %s", ui.auth.session_user(request), said)
        ui.flash(request, "ok" if ok else "error", said)
        return RedirectResponse("/streams", status_code=303)

    def routes(self) -> list[Route]:
        a = self.ui.actor
        return [
            Route("/dags/{dag_id}/trigger", a(self.trigger_form), methods=["POST"]),
            Route("/dags/{dag_id}/pause", a(self.pause_form(True)), methods=["POST"]),
            Route("/dags/{dag_id}/unpause", a(self.pause_form(False)), methods=["POST"]),
            Route("/dags/{dag_id}/change", a(self.change_form), methods=["POST"]),
            Route("/streams/dead", a(self.dead_letter_form), methods=["POST"]),
        ]
