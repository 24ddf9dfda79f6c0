"""The API's answers: JSON of the read model's records, one-line errors, and when to try again
after a refusal."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse, Response

from readmodel.records import json_value
from webserver.auth import Verdict
from webserver.data import json_ready
from webserver.ratelimits import Refusal
from webserver.tokens import SCOPES, Bearer


def api_answer(payload: Any, status_code: int = 200) -> Response:
    body = json.dumps(json_ready(payload), default=json_value)
    return Response(body, status_code=status_code, media_type="application/json")


# The header a client sends its idempotency key in, and the one a repeat's answer carries
# (Stripe's names).
IDEMPOTENCY_HEADER = "idempotency-key"
REPLAYED_HEADER = "idempotent-replayed"


def replayed_if(response: Response, replayed: bool) -> Response:
    """``response``, marked as a repeat's (the first request's answer) when ``replayed``."""
    if replayed:
        response.headers[REPLAYED_HEADER] = "true"
    return response


def api_error(status_code: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status_code)


def with_retry_after(response: Response, verdict: Verdict) -> Response:
    if verdict.retry_after_sec > 0:
        return retry_after(response, max(1, round(verdict.retry_after_sec)))
    return response


def retry_after(response: Response, seconds: int) -> Response:
    response.headers["retry-after"] = str(seconds)
    return response


def refusal_line(refused: Refusal) -> str:
    return f"{refused.message}; try again in {refused.retry_after_sec} s"


def too_many(refused: Refusal) -> Response:
    return retry_after(api_error(429, refusal_line(refused)), refused.retry_after_sec)


def basic_refused(verdict: Verdict) -> Response:
    if verdict.retry_after_sec > 0:
        seconds = max(1, round(verdict.retry_after_sec))
        refused = api_error(429, f"too many failed logins: try again in {seconds} s")
        return with_retry_after(refused, verdict)
    return api_error(401, "wrong user name or password")


def no_token_here() -> Response:
    """An API token sent where only a login serves."""
    return api_error(403, f"API tokens are for {', '.join(SCOPES)} only: this path needs a login")


def token_acting(bearer: Bearer | None, scope: str) -> str | Response:
    """Who an API token (None: not a valid one) acts as where ``scope`` is needed, or why it
    may not."""
    if bearer is None:
        return api_error(401, "API token unknown, revoked or malformed")
    if scope not in bearer.scopes:
        return api_error(403, f"API token {bearer.name!r} lacks the {scope!r} scope")
    return bearer.acting
