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
from deferral.store import actions
from deferral.store.callback_tokens import TokenRefused, read_token
from deferral.store.db import unreachable
from webserver import tokens
from webserver.access_log import CALLBACK_PATH
from webserver.answers import (
    IDEMPOTENCY_HEADER,
    api_answer,
    api_error,
    replayed_if,
    token_acting,
    too_many,
)
from webserver.inputs import BadInput, parse_json
from webserver.ratelimits import RUNS, SIGNALS, limited_as
from webserver.reads import Reads
from webserver.signalbatch import Send
from webserver.urls import API
from webserver.writes import Writes

if TYPE_CHECKING:
    from webserver.app import Handler, WebUI


# The routes an API token serves (``machine.MachinePath`` serves a token's requests to them
# past the browser's middlewares).
SIGNAL_PATH = f"{API}/signals/{{key}}"
TRIGGER_PATH = f"{API}/dags/{{dag_id}}/runs"
TOKEN_PATHS = frozenset(
    {SIGNAL_PATH, TRIGGER_PATH, f"{CALLBACK_PATH}{{token}}", f"{CALLBACK_PATH}{{token}}/heartbeat"}
)


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

    async def ready(self, request: Request) -> Response:
        """Readiness: 503 while PostgreSQL does not answer, so that a load balancer sends no
        one to a web UI that cannot read. (Health stays ok: a restart would not help.)"""
        why = await run_in_threadpool(unreachable, self.ui.sessions)
        if why is not None:
            return api_answer({"status": "not ready", "reason": why}, status_code=503)
        return api_answer({"status": "ready"})

    async def trigger(self, request: Request) -> Response:
        body = request.scope["body"]
        conf = body.get("conf", {})
        run_id = body.get("run_id")
        if not isinstance(conf, dict):
            raise BadInput("conf must be a JSON object")
        if run_id is not None and not isinstance(run_id, str):
            raise BadInput("run_id must be a string")
        partition_key = body.get("partition_key")
        if partition_key is not None and not isinstance(partition_key, str):
            raise BadInput("partition_key must be a string")
        acting = request.scope["acting_user"]
        refused = self.ui.limits.take(RUNS, limited_as(acting))
        if refused is not None:
            return too_many(refused)
        dag_id = request.path_params["dag_id"]
        keyed = self._idempotency_key(request, acting)
        triggered = await run_in_threadpool(
            self.writes.trigger, dag_id, json.dumps(conf), run_id, None, keyed, partition_key
        )
        return replayed_if(
            api_answer(
                {"dag_id": dag_id, "run_id": triggered.run_id, "paused": triggered.paused},
                status_code=201,
            ),
            triggered.replayed,
        )

    def _idempotency_key(self, request: Request, requester: str) -> actions.IdempotencyKey | None:
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is None:
            return None
        return actions.IdempotencyKey(key, self.ui.cipher, requester)

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
        """A signal, written with those sent beside it (``webserver.signalbatch``); with an
        API token, the token's row checked in the transaction that writes it."""
        payload = request.scope["body"].get("payload")
        acting = request.scope["acting_user"]
        refused = self.ui.limits.take(SIGNALS, limited_as(acting))
        if refused is not None:
            return too_many(refused)
        key = request.path_params["key"]
        send = Send(
            key,
            payload,
            signals.Sender(acting, self.ui.web.signals_kept_per_user),
            request.headers.get(IDEMPOTENCY_HEADER),
            request.scope.get("token_id"),
        )
        try:
            signals.check_signal_key(key)  # before its batch takes the key's lock
            sent = await self.ui.signal_batches.send(send)
        except signals.SignalError as exc:
            raise BadInput(str(exc)) from None
        except tokens.Revoked:
            self.ui.auth.forget_bearer(request)
            refusal = token_acting(None, tokens.SIGNALS)
            assert isinstance(refusal, Response)
            return refusal
        return replayed_if(
            api_answer(
                {"signal_id": sent.id, "key": sent.key, "resumed": len(sent.resumed)},
                status_code=201,
            ),
            sent.replayed,
        )

    async def callback(self, request: Request) -> Response:
        """A task's callback: no login (the token is the credential), a JSON body
        ``{"status": "success"|"failure", "payload": ...}``. A machine relaying callbacks may
        send an API token with the ``callbacks`` scope (``WebUI.token_optional``): its answers
        then count against that token's rate limit, not the callback token's."""
        token: str | None = request.scope["token_acting"]
        limited = None if token is None else limited_as(token)
        body = await request.body()
        try:
            answer = parse_json(body.decode(), "the body")
        except (UnicodeDecodeError, BadInput) as exc:
            return api_error(
                400, str(exc) if isinstance(exc, BadInput) else "the body is not UTF-8"
            )
        if not isinstance(answer, dict):
            return api_error(400, "the body must be a JSON object")
        cipher = self.ui.cipher
        try:
            claim = read_token(cipher, request.path_params["token"], dt.datetime.now(dt.UTC))
            refused = self.ui.limits.take(SIGNALS, limited or f"token:{claim.key}")
            if refused is not None:
                return too_many(refused)
            sent = await run_in_threadpool(
                self.writes.answer_callback,
                cipher,
                claim,
                answer.get("status"),
                answer.get("payload"),
                request.headers.get(IDEMPOTENCY_HEADER),
            )
        except TokenRefused as exc:
            return api_error(exc.status, str(exc))
        return replayed_if(api_answer({"resumed": len(sent.resumed)}), sent.replayed)

    async def callback_heartbeat(self, request: Request) -> Response:
        """A heartbeat of a task's callback (``CallbackTrigger(heartbeat=)``): no login, no
        body; the token is checked as for the answer, and its wait's deadline pushed on."""
        token: str | None = request.scope["token_acting"]
        try:
            claim = read_token(
                self.ui.cipher, request.path_params["token"], dt.datetime.now(dt.UTC)
            )
            refused = self.ui.limits.take(
                SIGNALS, f"token:{claim.key}" if token is None else limited_as(token)
            )
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
            Route(f"{API}/ready", self.ready),
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
            Route(TRIGGER_PATH, a(self.trigger, tokens.RUNS), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/pause", a(self.pause(True)), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/unpause", a(self.pause(False)), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/clear", a(self.clear), methods=["POST"]),
            Route(f"{API}/dags/{{dag_id}}/mark", a(self.mark), methods=["POST"]),
            Route(SIGNAL_PATH, a(self.signal, tokens.SIGNALS, rechecked=True), methods=["POST"]),
            Route(
                f"{CALLBACK_PATH}{{token}}",
                self.ui.token_optional(self.callback, tokens.CALLBACKS),
                methods=["POST"],
            ),
            Route(
                f"{CALLBACK_PATH}{{token}}/heartbeat",
                self.ui.token_optional(self.callback_heartbeat, tokens.CALLBACKS),
                methods=["POST"],
            ),
        ]
