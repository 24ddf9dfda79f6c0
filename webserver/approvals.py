"""Required actions (human in the loop): the page listing tasks awaiting input with a form to
respond, and the API (``GET /api/v1/hitlDetails``, ``POST /api/v1/hitlDetails/{id}``). A response
needs a logged-in user (a session with its CSRF token, or HTTP Basic for the API), recorded with
the time; ``deferral.store.hitl`` checks and applies it. Also the deadline misses
(``deadline_miss``):
``/deadline_misses`` and ``GET /api/v1/deadlineMisses``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from deferral.runtime.crypto import Cipher
from deferral.store import hitl
from deferral.store.serialized_dags import stored_params
from deferral.store.tables import DeadlineMiss
from webserver import paramform
from webserver.inputs import BadInput, int_param

if TYPE_CHECKING:
    from webserver.app import WebUI

API = "/api/v1"
PAGE = "/required_actions"
MISSES = "/deadline_misses"
MAX_MISSES_LISTED = 500


def _status(exc: hitl.ResponseError) -> int:
    if isinstance(exc, hitl.NoSuchTask):
        return 404
    return 409 if isinstance(exc, hitl.NotAwaitingInput) else 400


def _respond(
    ui: WebUI, ti_id: int, chosen: list[Any], params: dict[str, Any] | None, user: str
) -> dict[str, Any]:
    with ui.sessions.begin() as session:
        return hitl.respond(session, Cipher(ui.settings.fernet_keys), ti_id, chosen, params, user)


def _param_fields(params: Mapping[str, Any]) -> list[paramform.ParamField]:
    """The form's fields for the params a task asked for: the trigger form's, masked defaults
    included."""
    defaults = {name: spec.get("value") for name, spec in params.items()}
    return paramform.fields(stored_params(defaults, hitl.params_of(params)))


def _respond_to_form(
    ui: WebUI, ti_id: int, chosen: list[Any], form: Mapping[str, Any], user: str
) -> dict[str, Any]:
    """Respond with the form's param fields read as the trigger form's are: each parsed as its
    kind, one left at its masked default (or empty) left out, so its default applies."""
    with ui.sessions() as session:
        asked = hitl.required_actions(session, task_instance_id=ti_id, limit=1)
    fields = _param_fields(asked[0].params) if asked else []
    return _respond(ui, ti_id, chosen, paramform.conf_from_form(fields, form), user)


def _shown(action: hitl.RequiredAction, form: bool = False) -> dict[str, Any]:
    """A request as pages and the API show it: a secret-looking param's default and answer
    masked, as the trigger form masks a DAG's; with ``form``, the fields to respond with."""
    shown = action.as_json()
    defaults = paramform.shown_values({n: spec.get("value") for n, spec in action.params.items()})
    shown["params"] = {n: {**spec, "value": defaults[n]} for n, spec in action.params.items()}
    if action.params_input is not None:
        shown["params_input"] = paramform.shown_values(action.params_input)
    if form:
        shown["param_fields"] = [asdict(f) for f in _param_fields(action.params)]
    return shown


def _listed(
    ui: WebUI, pending: bool, dag_id: str | None, limit: int, form: bool = False
) -> list[dict[str, Any]]:
    with ui.sessions() as session:
        found = hitl.required_actions(session, pending=pending, dag_id=dag_id, limit=limit)
    return [_shown(action, form) for action in found]


def _misses(ui: WebUI, dag_id: str | None, limit: int) -> list[dict[str, Any]]:
    query = select(DeadlineMiss).order_by(DeadlineMiss.id.desc()).limit(limit)
    if dag_id is not None:
        query = query.where(DeadlineMiss.dag_id == dag_id)
    with ui.sessions() as session:
        return [
            {
                "dag_id": m.dag_id,
                "run_id": m.run_id,
                "alert_index": m.alert_index,
                "deadline": m.deadline.isoformat(),
                "missed_at": m.missed_at.isoformat(),
                "callback_state": m.callback_state,
            }
            for m in session.scalars(query)
        ]


def page_routes(ui: WebUI) -> list[Route]:
    async def page(request: Request) -> Response:
        pending = await run_in_threadpool(_listed, ui, True, None, hitl.MAX_LISTED, True)
        answered = [
            a
            for a in await run_in_threadpool(_listed, ui, False, None, 50)
            if a["responded_at"] is not None
        ]
        return await ui.page(
            request, "required_actions.html", {"pending": pending, "answered": answered}
        )

    async def respond_form(request: Request) -> Response:
        form = request.scope["form"]
        ti_id = int_param(str(request.path_params["ti_id"]), "task instance id", low=1)
        assert ti_id is not None
        chosen = [v for v in form.getlist("chosen_options") if isinstance(v, str)]
        user = await run_in_threadpool(ui.auth.session_user, request)
        assert user is not None
        try:
            await run_in_threadpool(_respond_to_form, ui, ti_id, chosen, form, user)
        except (hitl.ResponseError, BadInput) as exc:
            ui.flash(request, "error", str(exc))
        else:
            ui.flash(request, "ok", f"responded {', '.join(chosen)} to task instance {ti_id}")
        return RedirectResponse(PAGE, status_code=303)

    async def misses_page(request: Request) -> Response:
        found = await run_in_threadpool(_misses, ui, None, MAX_MISSES_LISTED)
        return await ui.page(request, "deadline_misses.html", {"misses": found})

    return [
        Route(PAGE, ui.reader(page)),
        Route(MISSES, ui.reader(misses_page)),
        Route(f"{PAGE}/{{ti_id:int}}/respond", ui.actor(respond_form), methods=["POST"]),
    ]


def api_routes(ui: WebUI) -> list[Route]:
    async def listing(request: Request) -> Response:
        query = request.query_params
        dag_id = query.get("dag_id")
        if dag_id is not None and len(dag_id) > 250:
            raise BadInput("dag_id is longer than 250 characters")
        limit = int_param(query.get("limit"), "limit", low=1, high=hitl.MAX_LISTED) or 100
        pending = query.get("state", "pending") == "pending"
        found = await run_in_threadpool(_listed, ui, pending, dag_id, limit)
        return JSONResponse({"hitl_details": found, "total_entries": len(found)})

    async def respond(request: Request) -> Response:
        body = request.scope["body"]
        ti_id = int_param(str(request.path_params["ti_id"]), "task instance id", low=1)
        assert ti_id is not None
        chosen, params = body.get("chosen_options"), body.get("params_input")
        if not isinstance(chosen, list):
            raise BadInput("chosen_options must be a list of options")
        if params is not None and not isinstance(params, dict):
            raise BadInput("params_input must be a JSON object")
        try:
            event = await run_in_threadpool(
                _respond, ui, ti_id, chosen, params, request.scope["acting_user"]
            )
        except hitl.ResponseError as exc:
            return JSONResponse({"error": str(exc)}, status_code=_status(exc))
        return JSONResponse(
            {
                "task_instance_id": ti_id,
                "chosen_options": event["chosen_options"],
                "params_input": paramform.shown_values(event["params_input"]),
                "responded_by": event["responded_by_user"],
                "responded_at": event["responded_at"].isoformat(),
            }
        )

    async def misses(request: Request) -> Response:
        dag_id = request.query_params.get("dag_id")
        if dag_id is not None and len(dag_id) > 250:
            raise BadInput("dag_id is longer than 250 characters")
        limit = int_param(request.query_params.get("limit"), "limit", low=1, high=MAX_MISSES_LISTED)
        found = await run_in_threadpool(_misses, ui, dag_id, limit or 100)
        return JSONResponse({"deadline_misses": found, "total_entries": len(found)})

    return [
        Route(f"{API}/deadlineMisses", ui.api_reader(misses)),
        Route(f"{API}/hitlDetails", ui.api_reader(listing)),
        Route(f"{API}/hitlDetails/{{ti_id:int}}", ui.api_actor(respond), methods=["POST"]),
    ]
