"""The JSON API under ``/api/v1/``: the read model's records as the pages show them (`reads`),
and the writes of the forms (`writes`) for scripts, answered in JSON."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from deferral import signals
from deferral.runtime.crypto import Cipher
from deferral.store import actions
from deferral.store.callback_tokens import TokenRefused, read_token
from webserver.access_log import CALLBACK_PATH
from webserver.answers import api_answer, api_error, too_many
from webserver.inputs import BadInput, parse_json
from webserver.ratelimits import RUNS, SIGNALS
from webserver.reads import Reads
from webserver.urls import API
from webserver.writes import Writes

if TYPE_CHECKING:
    from webserver.app import Handler, WebUI


class Api:
    def __init__(self, ui: WebUI, reads: Reads, writes: Writes) -> None:
        self.ui = ui
        self.reads = reads
        self.writes = writes

    def reading(self, read: Callable[[Request], Any]) -> Handler:
        """The answer of an API read: ``read``'s record, in JSON."""

        async def handler(request: Request) -> Response:
            return api_answer(await run_in_threadpool(read, request))

        return handler

    async def health(self, request: Request) -> Response:
        return api_answer({"status": "ok"})

    async def trigger(self, request: Request) -> Response:
        body = request.scope["body"]
        conf = body.get("conf", {})
        run_id = body.get("run_id")
        if not isinstance(conf, dict):
            raise BadInput("conf must be a JSON object")
        if run_id is not None and not isinstance(run_id, str):
            raise BadInput("run_id must be a string")
        refused = self.ui.limits.take(RUNS, f"user:{request.scope['acting_user']}")
        if refused is not None:
            return too_many(refused)
        dag_id = request.path_params["dag_id"]
        triggered = await run_in_threadpool(self.writes.trigger, dag_id, json.dumps(conf), run_id)
        return api_answer(
            {"dag_id": dag_id, "run_id": triggered.run_id, "paused": triggered.paused},
            status_code=201,
        )

    def pause(self, paused: bool) -> Handler:
        async def handler(request: Request) -> Response:
            dag_id = request.path_params["dag_id"]
            await run_in_threadpool(self.writes.set_paused, dag_id, paused)
            return api_answer({"dag_id": dag_id, "is_paused": paused})

        return handler

    async def clear(self, request: Request) -> Response:
        return await self._change(request, actions.clear_change)

    async def mark(self, request: Request) -> Response:
        state = request.scope["body"].get("state")
        return await self._change(
            request, actions.mark_change(state if isinstance(state, str) else repr(state))
        )

    async def _change(self, request: Request, change: actions.Change) -> Response:
        dag_id = request.path_params["dag_id"]
        done = await run_in_threadpool(self.writes.change, dag_id, request.scope["body"], change)
        return api_answer(
            {
                "changed": [{"task": label, "state": state} for label, state in done.changed],
                "refused": done.refused,
            },
            status_code=409 if done.refused else 200,
        )

    async def signal(self, request: Request) -> Response:
        payload = request.scope["body"].get("payload")
        acting = request.scope["acting_user"]
        refused = self.ui.limits.take(SIGNALS, f"user:{acting}")
        if refused is not None:
            return too_many(refused)
        sender = signals.Sender(acting, self.ui.web.signals_kept_per_user)
        sent = await run_in_threadpool(
            self.writes.send_signal, request.path_params["key"], payload, sender
        )
        return api_answer(
            {"signal_id": sent.id, "key": sent.key, "resumed": len(sent.resumed)}, status_code=201
        )

    async def callback(self, request: Request) -> Response:
        """A task's callback: no login (the token is the credential), a JSON body
        ``{"status": "success"|"failure", "payload": ...}``."""
        body = await request.body()
        try:
            answer = parse_json(body.decode(), "the body")
        except (UnicodeDecodeError, BadInput) as exc:
            return api_error(
                400, str(exc) if isinstance(exc, BadInput) else "the body is not UTF-8"
            )
        if not isinstance(answer, dict):
            return api_error(400, "the body must be a JSON object")
        cipher = Cipher(self.ui.settings.fernet_keys)
        try:
            claim = read_token(cipher, request.path_params["token"], dt.datetime.now(dt.UTC))
            refused = self.ui.limits.take(SIGNALS, f"token:{claim.key}")
            if refused is not None:
                return too_many(refused)
            sent = await run_in_threadpool(
                self.writes.answer_callback,
                cipher,
                claim,
                answer.get("status"),
                answer.get("payload"),
            )
        except TokenRefused as exc:
            return api_error(exc.status, str(exc))
        return api_answer({"resumed": len(sent.resumed)})

    async def callback_heartbeat(self, request: Request) -> Response:
        """A heartbeat of a task's callback (``CallbackTrigger(heartbeat=)``): no login, no
        body; the token is checked as for the answer, and its wait's deadline pushed on."""
        cipher = Cipher(self.ui.settings.fernet_keys)
        try:
            claim = read_token(cipher, request.path_params["token"], dt.datetime.now(dt.UTC))
            refused = self.ui.limits.take(SIGNALS, f"token:{claim.key}")
            if refused is not None:
                return too_many(refused)
            due = await run_in_threadpool(self.writes.callback_heartbeat, claim)
        except TokenRefused as exc:
            return api_error(exc.status, str(exc))
        return api_answer({"next_heartbeat_by": due.isoformat()})

    def routes(self) -> list[Route]:
        r, a, read = self.ui.api_reader, self.ui.api_actor, self.reading
        reads = self.reads
        return [
            Route(f"{API}/health", self.health),
            Route(f"{API}/dags", r(read(reads.dags_overview))),
            Route(f"{API}/dags/{{dag_id}}", r(read(reads.dag_detail))),
            Route(f"{API}/dags/{{dag_id}}/task_instance", r(read(reads.task_instance))),
            Route(f"{API}/dags/{{dag_id}}/task_instance/log", r(read(reads.task_log))),
            Route(f"{API}/deferred", r(read(reads.deferred))),
            Route(f"{API}/runs", r(read(reads.runs))),
            Route(f"{API}/task_instances", r(read(reads.task_list))),
            Route(f"{API}/triggers", r(read(reads.triggers))),
            Route(f"{API}/triggerers", r(read(reads.processes))),
            Route(f"{API}/streams", r(read(reads.streams))),
            Route(f"{API}/doctor", r(read(reads.doctor))),
            Route(f"{API}/dags/{{dag_id}}/runs", a(self.trigger), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/pause", a(self.pause(True)), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/unpause", a(self.pause(False)), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/clear", a(self.clear), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/mark", a(self.mark), methods=["POST"]),
            Route(f"{API}/signals/{{key}}", a(self.signal), methods=["POST"]),
            Route(f"{CALLBACK_PATH}{{token}}", self.callback, methods=["POST"]),
            Route(f"{CALLBACK_PATH}{{token}}/heartbeat", self.callback_heartbeat, methods=["POST"]),
        ]
