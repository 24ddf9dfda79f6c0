"""Runs one task attempt inside a worker child process and reports its outcome.

The operator is a deep copy of the one the DAG file built, so nothing set on ``self`` survives
from one attempt (or from before a deferral) to the next: a resumed task is a fresh instance.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import logging
import socket
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any

import msgspec

# DAG files import the TaskFlow decorators: loaded with the task runtime, so that every task
# process forked from the worker has them (as when `import deferral` loaded them everywhere).
import deferral.decorators  # noqa: F401
from deferral.assets import Asset
from deferral.authoring.callbacks import run_callbacks
from deferral.authoring.mappedoperator import MappedOperator
from deferral.authoring.templating import render_and_record
from deferral.baseoperator import BaseOperator
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance, make_context
from deferral.exceptions import (
    FailTask,
    InactiveAssetInInletOrOutlet,
    RescheduleTask,
    SkipTask,
    TaskAwaitingInput,
    TaskDeferred,
    TaskExecutionTimeout,
)
from deferral.loading import task_runtime
from deferral.models.xcom import resolve_xcom_backend
from deferral.runtime import clock, serialization
from deferral.runtime.config import ConfigError, smtp_settings
from deferral.runtime.process import freeze_startup_objects, raising_after
from deferral.runtime.secrets_masker import redact
from deferral.runtime.serialization import SerializationError, from_jsonable, to_jsonable
from deferral.states import FAIL_METHOD
from deferral.store import assets as stored_assets
from deferral.store.hitl import InputRequest, check_request
from deferral.store.metastore import metastore, wait_for_the_server
from deferral.store.transitions import has_tries_left
from deferral.store.xcom import RETURN_VALUE, DatabaseXComs, stored_value
from deferral.triggers.base import BaseTrigger
from deferral.triggers.signal import check_cancel_on
from deferral.utils.email import failure_alert
from worker import decide
from worker.outcomes import (
    AttemptRequest,
    AwaitingInput,
    Deferred,
    Failed,
    Outcome,
    Rescheduled,
    Skipped,
    Succeeded,
)

log = logging.getLogger("deferral.worker.attempt")


@cache
def _xcoms() -> DatabaseXComs:
    # The engine Variables, Connections and rendered fields use too: one pool per task process.
    return DatabaseXComs(metastore().sessions, resolve_xcom_backend())


def warm_up() -> None:
    """Run once in each new task process before it takes attempts. (The DAGs folder is not
    loaded here: each attempt imports only its own DAG's file, once per process.)"""
    # Attempts log at INFO (capture.TaskOutput); set here once, not per attempt.
    logging.getLogger().setLevel(logging.INFO)
    # Task code's reads of the database wait out a server that refuses for a moment.
    wait_for_the_server()
    # Registers the SMTP password with this process's masker (the worker checked the settings).
    with contextlib.suppress(ConfigError):
        smtp_settings()
    freeze_startup_objects()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _failed(exc: BaseException, *, allow_retry: bool) -> Failed:
    return Failed(_one_line(exc), traceback.format_exc(), allow_retry)


@contextmanager
def _time_limit(deadline: dt.datetime | None) -> Iterator[None]:
    """Raise TaskExecutionTimeout in the task when the deadline passes (child main thread)."""
    if deadline is None:
        yield
        return
    left = (deadline - dt.datetime.now(dt.UTC)).total_seconds()
    if left <= 0:
        raise TaskExecutionTimeout("execution_timeout passed before the task resumed")

    message = f"execution_timeout passed (deadline {deadline.isoformat()})"
    with raising_after(left, lambda: TaskExecutionTimeout(message)):
        yield


def _context(request: AttemptRequest, task: BaseOperator) -> Context:
    ti = RuntimeTaskInstance(
        id=request.task_instance_id,
        dag_id=request.dag_id,
        run_id=request.run_id,
        task_id=request.task_id,
        map_index=request.map_index,
        try_number=request.try_number,
        xcoms=_xcoms(),
        first_started_at=request.first_started_at,
    )
    run = DagRunInfo(
        dag_id=request.dag_id,
        run_id=request.run_id,
        logical_date=request.logical_date,
        conf=request.conf,
        data_interval_start=request.data_interval_start,
        data_interval_end=request.data_interval_end,
        run_type=request.run_type,
        partition_key=request.partition_key,
    )
    return make_context(task, run, ti)


def _check_assets_active(task: BaseOperator) -> None:
    """Fail the task before it runs if an asset among its inlets or outlets is inactive
    (deferral/store/assets.py), as Airflow's task runner does at its start."""
    named = [
        asset
        for asset in (
            *(getattr(task, "inlets", None) or ()),
            *(getattr(task, "outlets", None) or ()),
        )
        if isinstance(asset, Asset) and not asset.is_ref
    ]
    if not named:
        return
    inactive = stored_assets.inactive_in_store(named)
    if inactive:
        raise InactiveAssetInInletOrOutlet([(asset.name, asset.uri) for asset in inactive])


def _call(
    task: BaseOperator,
    request: AttemptRequest,
    next_kwargs: dict[str, Any] | None,
    context: Context,
) -> Any:
    if request.next_method is None:
        if task.start_from_trigger and task.start_trigger_args is not None:
            task.defer_to_start_trigger(task.start_trigger_args)
        result = task.execute(context)
    else:
        result = task.resume_execution(request.next_method, next_kwargs, context)
    task.post_execute(context, result)
    push_outputs(task, result, context["ti"])
    return result


def push_outputs(task: BaseOperator, value: Any, ti: RuntimeTaskInstance) -> None:
    """``multiple_outputs``: each key of the returned dict as its own XCom, as Airflow (which
    fails the task when the value is not a dict with str keys)."""
    if not task.multiple_outputs or not task.do_xcom_push or value is None:
        return
    task_id = task.task_id
    if not isinstance(value, Mapping):
        raise TypeError(
            f"task {task_id!r} has multiple_outputs but returned {type(value).__name__}, not a dict"
        )
    for key in value:
        if not isinstance(key, str):
            raise TypeError(
                f"task {task_id!r} has multiple_outputs: the keys of the dict it returns must"
                f" be str, got {key!r} ({type(key).__name__})"
            )
    for key, item in value.items():
        ti.xcom_push(key, item)


def _deferral(task: BaseOperator, deferred: TaskDeferred, deadline: dt.datetime | None) -> Outcome:
    where = f"task {task.task_id!r}"
    if not isinstance(deferred.trigger, BaseTrigger):
        return Failed(f"{where} deferred to {deferred.trigger!r}, not a BaseTrigger", "", False)
    if not callable(getattr(task, deferred.method_name, None)):
        return Failed(f"{where} deferred to a method it lacks: {deferred.method_name!r}", "", False)
    if deferred.timeout is not None and not isinstance(deferred.timeout, dt.timedelta):
        return Failed(f"{where} deferred with a timeout that is not a timedelta", "", False)
    try:
        check_cancel_on(deferred.cancel_on, deferred.cancel_state)
    except (TypeError, ValueError) as exc:
        return Failed(f"{where} cannot defer: {exc}", "", False)
    try:
        classpath, trigger_kwargs = deferred.trigger.serialize()
        checked_trigger = serialization.check_kwargs(trigger_kwargs, "trigger kwargs")
        checked_next = serialization.check_kwargs(deferred.kwargs, "defer kwargs")
        cancel_on = (
            None
            if deferred.cancel_on is None
            else serialization.check_kwargs(deferred.cancel_on.serialize()[1], "cancel_on")
        )
    except SerializationError as exc:
        return Failed(f"{where} cannot defer: {exc}", traceback.format_exc(), False)
    except Exception as exc:
        trigger_name = type(deferred.trigger).__name__
        return Failed(
            f"{where} cannot defer: {trigger_name}.serialize() raised {_one_line(exc)}",
            traceback.format_exc(),
            False,
        )
    return Deferred(
        classpath=classpath,
        trigger_kwargs=checked_trigger,
        method_name=deferred.method_name,
        next_kwargs=checked_next,
        trigger_timeout=decide.trigger_timeout(dt.datetime.now(dt.UTC), deferred.timeout, deadline),
        # A cancel-on is one task's: its trigger is not shared.
        shared=type(deferred.trigger).shared is True and cancel_on is None,
        cancel_on=cancel_on,
        cancel_state=deferred.cancel_state,
    )


def _awaiting_input(task: BaseOperator, asked: TaskAwaitingInput) -> Outcome:
    """The request an HITLOperator raised, checked again (its fields were rendered since the
    DAG loaded) and carried to the worker, which records it."""
    request = asked.request
    where = f"task {task.task_id!r}"
    if not isinstance(request, InputRequest):
        return Failed(f"{where} awaits input with {request!r}, not an InputRequest", "", False)
    try:
        check_request(request, where)
        params = serialization.check_kwargs(dict(request.params), "HITL params")
    except (ValueError, SerializationError) as exc:
        return Failed(f"{where} cannot await input: {exc}", "", False)
    return AwaitingInput(
        subject=request.subject,
        body=request.body,
        options=request.options,
        defaults=request.defaults,
        multiple=request.multiple,
        params=params,
        timeout=request.timeout,
    )


def _kill(task: BaseOperator) -> None:
    """The task was cut short by its execution_timeout: let it stop what it started."""
    try:
        task.on_kill()
    except Exception:
        log.exception("task %r: on_kill raised", task.task_id)


def _succeeded(
    task: BaseOperator, request: AttemptRequest, context: Context, result: Any
) -> Outcome:
    """The task returned: its return value (if pushed) in to_jsonable form, the tasks it chose to
    skip, and its success callbacks run."""
    try:
        value = (
            stored_value(
                resolve_xcom_backend(),
                result,
                key=RETURN_VALUE,
                dag_id=request.dag_id,
                run_id=request.run_id,
                task_id=request.task_id,
                map_index=request.map_index,
                what=f"return value of task {task.task_id!r}",
            )
            if task.do_xcom_push and result is not None
            else None
        )
        extras = to_jsonable(
            context["outlet_events"].extras(), f"outlet event extras of task {task.task_id!r}"
        )
        alias_events = to_jsonable(
            context["outlet_events"].alias_events(),
            f"alias events of task {task.task_id!r}",
        )
    except SerializationError as exc:
        return _after_failure(task, request, context, exc, Failed(str(exc), "", allow_retry=False))
    what = f"task {task.task_id!r} on_success_callback"
    run_callbacks(task.on_success_callback, context, what=what)
    return Succeeded(
        value,
        tuple(sorted(context["ti"].skip_task_ids)),
        extras,
        alias_events,
        context["outlet_events"].partitions(context["partition_key"]),
    )


def _after_failure(
    task: BaseOperator,
    request: AttemptRequest,
    context: Context | None,
    exc: BaseException,
    outcome: Failed,
) -> Failed:
    """Run on_retry_callback if the failure will be retried, else on_failure_callback, with the
    exception in the context under ``exception``; add the email alert that is due."""
    retrying = outcome.allow_retry and has_tries_left(request.try_number, request.max_tries)
    if context is not None:
        name = "on_retry_callback" if retrying else "on_failure_callback"
        run_callbacks(
            getattr(task, name),
            {**context, "exception": exc},
            what=f"task {task.task_id!r} {name}",
        )
    alert = failure_alert(
        task,
        retrying=retrying,
        dag_id=request.dag_id,
        run_id=request.run_id,
        map_index=request.map_index,
        try_number=request.try_number,
        max_tries=request.max_tries,
        error=redact(f"{type(exc).__name__}: {exc}"),
        hostname=socket.gethostname(),
    )
    return msgspec.structs.replace(outcome, alert=alert) if alert else outcome


def _after_skip(task: BaseOperator, context: Context | None, exc: SkipTask) -> Skipped:
    """The task skipped itself (raised SkipTask, as a sensor's soft_fail does): its
    on_skipped_callback runs, as in Airflow; a task skipped by a branch or a trigger rule never
    runs, so none is called for it."""
    if context is not None:
        what = f"task {task.task_id!r} on_skipped_callback"
        run_callbacks(task.on_skipped_callback, context, what=what)
    return Skipped(_one_line(exc))


def execute_attempt(request: AttemptRequest) -> Outcome:
    """Entry point in the child process. What it says of an error leaves with secrets masked:
    only this process knows the secrets its task read, and the worker records and logs it."""
    task_runtime.install()
    clock.correct_by(request.clock_correction_sec)
    return _masked(_execute(request))


def _execute(request: AttemptRequest) -> Outcome:
    try:
        next_kwargs = None if request.next_kwargs is None else from_jsonable(request.next_kwargs)
    except SerializationError as exc:
        return Failed(f"cannot run: resume kwargs: {exc}", "", allow_retry=False)
    try:
        dag = task_runtime.folder_dag(request.dag_id)
        task = copy.deepcopy(dag.get_task(request.task_id))
    except Exception as exc:
        return _failed(exc, allow_retry=True)
    outcome = _run(task, request, next_kwargs)
    if isinstance(outcome, Failed) and outcome.allow_retry:
        return msgspec.structs.replace(outcome, retry_delay=task.retry_delay)
    return outcome


def _masked(outcome: Outcome) -> Outcome:
    if isinstance(outcome, Failed):
        return msgspec.structs.replace(
            outcome, error=redact(outcome.error), traceback=redact(outcome.traceback)
        )
    if isinstance(outcome, Skipped):
        return Skipped(redact(outcome.reason))
    return outcome


def _run(
    task: BaseOperator, request: AttemptRequest, next_kwargs: dict[str, Any] | None
) -> Outcome:
    deadline = decide.execution_deadline(request.first_started_at, task.execution_timeout)
    context: Context | None = None
    try:
        context = _context(request, task)
        if isinstance(task, MappedOperator):
            # The operator of this map index, given its values (pulled now), as Airflow unmaps.
            task = task.unmap(context)
            context["task"] = task
        _check_assets_active(task)
        # On every attempt, resumed ones too, as Airflow; XComArgs are pulled here.
        render_and_record(task, context)
        what = f"task {task.task_id!r} on_execute_callback"
        run_callbacks(task.on_execute_callback, context, what=what)
        # A deferral that ended without an event (``__fail__``) is reported by
        # resume_execution without the deadline check, so one cut short by that very
        # deadline reports as a deferral timeout.
        failing = request.next_method == FAIL_METHOD
        with _time_limit(None if failing else deadline):
            result = _call(task, request, next_kwargs, context)
    except TaskDeferred as deferred:
        return _deferral(task, deferred, deadline)
    except TaskAwaitingInput as asked:
        return _awaiting_input(task, asked)
    except SkipTask as exc:
        return _after_skip(task, context, exc)
    except RescheduleTask as exc:
        return Rescheduled(exc.reschedule_date)
    except FailTask as exc:
        return _after_failure(task, request, context, exc, _failed(exc, allow_retry=False))
    except TaskExecutionTimeout as exc:
        _kill(task)
        return _after_failure(task, request, context, exc, _failed(exc, allow_retry=True))
    except Exception as exc:
        return _after_failure(task, request, context, exc, _failed(exc, allow_retry=True))
    return _succeeded(task, request, context, result)
