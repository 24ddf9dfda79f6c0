"""Human in the loop: what a task awaiting input asks (``hitl_detail``), the checks a response
passes, and the response itself, from a person (web UI, API, CLI) or from the timeout.

A task may also wait for an answer as a deferral (``ApprovalTrigger``, alone or as a branch of an
``AnyOf`` / ``AllOf``): its request is recorded here when it defers and listed with the others;
an answer resolves its wait row (``deferral.store.waits.resolve``) in the answering transaction.

A response moves the task awaiting_input -> scheduled at ``execute_complete`` with the response as
its event, in the transaction that records who responded and when: the task instance is locked
first, so of two responses (or a response and the timeout, or two scheduler replicas) exactly one
applies and the other is told why not, in one line.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, cast, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from deferral.models.param import Param, ParamValidationError
from deferral.runtime import storable
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import TaskState
from deferral.store import transitions, waits
from deferral.store.tables import HITLDetail, SignalWait, TaskInstance
from deferral.triggers.approval import APPROVAL_KEY_PREFIX, approval_key

# Bounds on what a task may ask and a person may answer (anyone with a browser is an attacker).
MAX_OPTIONS = 100
MAX_OPTION_CHARS = 200
MAX_SUBJECT_CHARS = 1_000
MAX_BODY_CHARS = 20_000
MAX_PARAMS_BYTES = 64 * 1024  # the params' definitions, and a response's params_input, as JSON
MAX_LISTED = 500

# The method a response resumes the task at (Airflow's name).
RESUME_METHOD = "execute_complete"


class ResponseError(ValueError):
    """A response that cannot be applied; the message (one line) names what is at fault."""


class NotAwaitingInput(ResponseError):
    """The task is not (or no longer) awaiting input: already responded, cleared, finished."""


class NoSuchTask(ResponseError):
    """No task instance has that id."""


@dataclass(frozen=True)
class InputRequest:
    """What an ``HITLOperator`` asks, as it is stored."""

    subject: str
    body: str | None
    options: tuple[str, ...]
    defaults: tuple[str, ...] | None
    multiple: bool
    params: Mapping[str, Any]  # ParamsDict.dump(): name -> {value, description, schema}
    timeout: dt.timedelta | None  # the response timeout (the task's execution_timeout)


def check_request(request: InputRequest, where: str) -> None:
    """Raise ValueError (one line naming ``where``) for a request out of bounds or inconsistent:
    the same checks when the DAG loads and when the worker records the request."""
    if not request.options:
        raise ValueError(f"{where}: options must not be empty")
    if len(request.options) > MAX_OPTIONS:
        raise ValueError(f"{where}: {len(request.options)} options, at most {MAX_OPTIONS}")
    if len(set(request.options)) != len(request.options):
        raise ValueError(f"{where}: options must be unique")
    for option in request.options:
        if not isinstance(option, str) or not option or len(option) > MAX_OPTION_CHARS:
            raise ValueError(
                f"{where}: option {option!r} must be a non-empty string of at most"
                f" {MAX_OPTION_CHARS} characters"
            )
    if request.defaults is not None:
        if not set(request.defaults) <= set(request.options):
            raise ValueError(
                f"{where}: defaults {list(request.defaults)} are not among the options"
                f" {list(request.options)}"
            )
        if not request.multiple and len(request.defaults) > 1:
            raise ValueError(f"{where}: more than one default when multiple is False")
    if not isinstance(request.subject, str) or len(request.subject) > MAX_SUBJECT_CHARS:
        raise ValueError(f"{where}: subject must be a string of at most {MAX_SUBJECT_CHARS} chars")
    if request.body is not None and len(request.body) > MAX_BODY_CHARS:
        raise ValueError(f"{where}: body longer than {MAX_BODY_CHARS} characters")
    if len(_json(request.params, where)) > MAX_PARAMS_BYTES:
        raise ValueError(f"{where}: params larger than {MAX_PARAMS_BYTES} bytes as JSON")


def _json(value: Any, where: str) -> str:
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None


def record_request(
    session: Session, task_instance_id: int, try_number: int, request: InputRequest
) -> None:
    """Store what the task asks (a new try's request replaces the last try's, response too)."""
    timeout_at = None if request.timeout is None else dt.datetime.now(dt.UTC) + request.timeout
    values = {
        "try_number": try_number,
        "subject": request.subject,
        "body": request.body,
        "options": list(request.options),
        "defaults": None if request.defaults is None else list(request.defaults),
        "multiple": request.multiple,
        "params": dict(request.params),
        "timeout_at": timeout_at,
        "responded_at": None,
        "responded_by": None,
        "chosen_options": None,
        "params_input": None,
    }
    session.execute(
        pg_insert(HITLDetail)
        .values(task_instance_id=task_instance_id, **values)
        .on_conflict_do_update(index_elements=["task_instance_id"], set_=values)
    )


def check_response(
    detail: HITLDetail, chosen_options: Sequence[Any], params_input: Mapping[str, Any] | None
) -> tuple[list[str], dict[str, Any]]:
    """The response's options and params, checked against what the task asked; ResponseError
    (one line) names the first thing at fault."""
    if not isinstance(chosen_options, list | tuple) or not chosen_options:
        raise ResponseError("chosen_options must be a non-empty list of options")
    if len(chosen_options) > MAX_OPTIONS:
        raise ResponseError(f"{len(chosen_options)} chosen options, at most {MAX_OPTIONS}")
    chosen = [str(option)[: MAX_OPTION_CHARS + 1] for option in chosen_options]
    try:
        storable.check({"chosen_options": chosen, "params_input": params_input}, "the response")
    except storable.UnstorableText as exc:
        raise ResponseError(str(exc)) from None
    for option in chosen:
        if option not in detail.options:
            raise ResponseError(f"unknown option {option!r}: expected one of {detail.options}")
    if len(set(chosen)) != len(chosen):
        raise ResponseError("an option is chosen twice")
    if not detail.multiple and len(chosen) > 1:
        raise ResponseError("only one option may be chosen (multiple is False)")
    if not isinstance(params_input, Mapping | None):
        raise ResponseError("params_input must be a JSON object")
    given = dict(params_input or {})
    if len(_json(given, "params_input")) > MAX_PARAMS_BYTES:
        raise ResponseError(f"params_input larger than {MAX_PARAMS_BYTES} bytes as JSON")
    unknown = sorted(set(given) - set(detail.params))
    if unknown:
        raise ResponseError(f"unknown param {unknown[0]!r}: expected {sorted(detail.params)}")
    return chosen, _params_values(detail.params, given)


def params_of(specs: Mapping[str, Any]) -> dict[str, Param]:
    """The ``Param`` of each param a task asked for (as stored: ``Param.dump()``)."""
    return {
        name: Param(spec.get("value"), spec.get("description"), **(spec.get("schema") or {}))
        for name, spec in specs.items()
    }


def _params_values(specs: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """Each param's value (given, else its default), checked against its schema."""
    values: dict[str, Any] = {}
    for name, param in params_of(specs).items():
        try:
            values[name] = param.resolve(given.get(name, param.value), name)
        except ParamValidationError as exc:
            raise ResponseError(str(exc)) from None
    return values


def _locked(session: Session, task_instance_id: int) -> tuple[TaskInstance, HITLDetail]:
    ti = session.scalar(
        select(TaskInstance).where(TaskInstance.id == task_instance_id).with_for_update()
    )
    if ti is None:
        raise NoSuchTask(f"task instance {task_instance_id} does not exist")
    detail = session.get(HITLDetail, task_instance_id, populate_existing=True)
    label = f"task {ti.dag_id}.{ti.run_id}.{ti.task_id}"
    answered = detail is not None and detail.responded_at is not None
    if answered and detail is not None and detail.try_number == ti.try_number:
        who = detail.responded_by or "the timeout"
        at = detail.responded_at
        raise NotAwaitingInput(f"{label} was already responded to by {who} at {at}")
    waiting = ti.state == TaskState.AWAITING_INPUT or (
        ti.state == TaskState.DEFERRED
        and session.scalar(
            select(_approval_waited(TaskInstance.id)).where(TaskInstance.id == ti.id)
        )
    )
    if not waiting or detail is None:
        raise NotAwaitingInput(f"{label} is not awaiting input (state {ti.state})")
    return ti, detail


def _approval_waited(task_instance_id: Any) -> Any:
    """True while the deferred task ``task_instance_id`` waits for its approval
    (``ApprovalTrigger``, alone or as a branch): its wait row is there and has not fired."""
    return (
        select(SignalWait.id)
        .where(
            SignalWait.key == literal(APPROVAL_KEY_PREFIX) + cast(task_instance_id, Text),
            SignalWait.fired.is_(None),
        )
        .exists()
    )


def respond(
    session: Session,
    cipher: Cipher,
    task_instance_id: int,
    chosen_options: Sequence[Any],
    params_input: Mapping[str, Any] | None,
    user: str,
) -> dict[str, Any]:
    """Apply a person's response: recorded with who and when, the task resumed. Returns what the
    task resumes with; ResponseError (NotAwaitingInput) in one line if it cannot apply."""
    ti, detail = _locked(session, task_instance_id)
    chosen, params = check_response(detail, chosen_options, params_input)
    return _apply(session, cipher, ti, detail, chosen, params, user)


def _apply(
    session: Session,
    cipher: Cipher,
    ti: TaskInstance,
    detail: HITLDetail,
    chosen: list[str] | None,
    params: dict[str, Any],
    user: str | None,
) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC)
    detail.responded_at = now
    detail.responded_by = user
    detail.chosen_options = chosen
    detail.params_input = params
    if ti.state == TaskState.DEFERRED:  # an ApprovalTrigger's wait (the task row is locked)
        answer = {"chosen_options": chosen, "responded_by_user": user, "responded_at": now}
        waits.resolve(session, cipher, approval_key(ti.id), f"approval:{ti.id}", answer)
        return answer
    event: dict[str, Any] = {
        "chosen_options": chosen,
        "params_input": params,
        "responded_at": now,
        "responded_by_user": user,
        "timedout": user is None,
    }
    reason = f"responded by {user}" if user else "response timeout passed"
    moved = transitions.resume_awaiting_input(
        session,
        ti.id,
        ti.try_number,
        next_method=RESUME_METHOD,
        next_kwargs_token=cipher.seal(Purpose.RESUME_KWARGS, {}, "next_kwargs"),
        next_event_token=cipher.seal(Purpose.EVENT, event, "event"),
        reason=reason,
    )
    if not moved:  # cannot happen under the lock; never record a response that did not apply
        raise NotAwaitingInput(f"task instance {ti.id} is not awaiting input")
    return event


def expire(session: Session, cipher: Cipher, limit: int = 1_000) -> list[int]:
    """Respond for every task whose response timeout passed: with its default options, or with
    none (the task then fails with HITLTimeoutError). Rows another replica holds are skipped:
    two schedulers never both apply one. Returns the task instance ids resumed."""
    due = session.execute(
        select(TaskInstance, HITLDetail)
        .join(HITLDetail, HITLDetail.task_instance_id == TaskInstance.id)
        .where(
            TaskInstance.state == TaskState.AWAITING_INPUT,
            HITLDetail.responded_at.is_(None),
            HITLDetail.timeout_at < dt.datetime.now(dt.UTC),
            HITLDetail.try_number == TaskInstance.try_number,
        )
        .order_by(HITLDetail.timeout_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    resumed = []
    for ti, detail in due:
        defaults = None if detail.defaults is None else list(detail.defaults)
        try:
            params = _params_values(detail.params, {}) if defaults is not None else {}
        except ResponseError:  # a param without a valid default: the defaults cannot apply
            defaults, params = None, {}
        _apply(session, cipher, ti, detail, defaults, params, None)
        resumed.append(ti.id)
    return resumed


@dataclass(frozen=True)
class RequiredAction:
    """A task awaiting input, as the web UI, the API and the CLI list it."""

    task_instance_id: int
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    subject: str
    body: str | None
    options: list[str]
    defaults: list[str] | None
    multiple: bool
    params: dict[str, Any]
    created_at: dt.datetime
    timeout_at: dt.datetime | None
    responded_at: dt.datetime | None
    responded_by: str | None
    chosen_options: list[str] | None
    params_input: dict[str, Any] | None
    state: str

    def as_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in ("created_at", "timeout_at", "responded_at"):
            out[key] = None if out[key] is None else out[key].isoformat()
        return out


def required_actions(
    session: Session,
    *,
    pending: bool = True,
    dag_id: str | None = None,
    task_instance_id: int | None = None,
    limit: int = 100,
) -> list[RequiredAction]:
    """Tasks awaiting input (``pending``), or every request recorded, newest first."""
    query = (
        select(TaskInstance, HITLDetail)
        .join(HITLDetail, HITLDetail.task_instance_id == TaskInstance.id)
        .order_by(HITLDetail.created_at.desc(), HITLDetail.task_instance_id.desc())
        .limit(max(1, min(limit, MAX_LISTED)))
    )
    if pending:
        query = query.where(
            (TaskInstance.state == TaskState.AWAITING_INPUT)
            | ((TaskInstance.state == TaskState.DEFERRED) & _approval_waited(TaskInstance.id)),
            HITLDetail.responded_at.is_(None),
        )
    if dag_id is not None:
        query = query.where(TaskInstance.dag_id == dag_id)
    if task_instance_id is not None:
        query = query.where(TaskInstance.id == task_instance_id)
    return [
        RequiredAction(
            task_instance_id=ti.id,
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            task_id=ti.task_id,
            map_index=ti.map_index,
            try_number=detail.try_number,
            subject=detail.subject,
            body=detail.body,
            options=list(detail.options),
            defaults=None if detail.defaults is None else list(detail.defaults),
            multiple=detail.multiple,
            params=dict(detail.params),
            created_at=detail.created_at,
            timeout_at=detail.timeout_at,
            responded_at=detail.responded_at,
            responded_by=detail.responded_by,
            chosen_options=detail.chosen_options,
            params_input=detail.params_input,
            state=ti.state,
        )
        for ti, detail in session.execute(query).all()
    ]
