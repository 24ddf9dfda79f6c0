"""Runs one task attempt inside a worker child process and reports its outcome.

The operator is a deep copy of the one the DAG file built, so nothing set on ``self`` survives
from one attempt (or from before a deferral) to the next: a resumed task is a fresh instance.
"""

from __future__ import annotations

import copy
import datetime as dt
import signal
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import FrameType
from typing import Any

from deferral import serialization
from deferral.baseoperator import BaseOperator
from deferral.config import load_settings
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance
from deferral.dagbag import DagBag
from deferral.db import make_engine, make_sessionmaker
from deferral.exceptions import (
    FailTask,
    RescheduleTask,
    SkipTask,
    TaskDeferralError,
    TaskDeferralTimeout,
    TaskDeferred,
    TaskExecutionTimeout,
)
from deferral.serialization import SerializationError
from deferral.states import FAIL_METHOD
from deferral.triggers.base import BaseTrigger
from deferral.xcom import DatabaseXComs
from worker import decide
from worker.outcomes import (
    AttemptRequest,
    Deferred,
    Failed,
    Outcome,
    Rescheduled,
    Skipped,
    Succeeded,
)


@cache
def _dagbag() -> DagBag:
    return DagBag(load_settings().dags_folder)


@cache
def _xcoms() -> DatabaseXComs:
    return DatabaseXComs(make_sessionmaker(make_engine(load_settings().database_url, pool_size=1)))


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

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TaskExecutionTimeout(f"execution_timeout passed (deadline {deadline.isoformat()})")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _context(request: AttemptRequest, task: BaseOperator) -> Context:
    assert task.dag is not None
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
    return {
        "ti": ti,
        "task": task,
        "dag": task.dag,
        "dag_run": DagRunInfo(request.dag_id, request.run_id, request.logical_date, request.conf),
        "run_id": request.run_id,
        "logical_date": request.logical_date,
        "params": {**task.dag.params, **request.conf},
        "try_number": request.try_number,
    }


def _raise_deferral_failure(request: AttemptRequest) -> None:
    """A task resumed at ``__fail__``: its deferral ended without an event. Raised before the
    execution deadline is checked, so a deferral cut short by that deadline reports as such."""
    if request.next_method == FAIL_METHOD:
        timed_out, message = decide.failure_message(dict(request.next_kwargs or {}))
        raise TaskDeferralTimeout(message) if timed_out else TaskDeferralError(message)


def _call(task: BaseOperator, request: AttemptRequest, context: Context) -> Any:
    if request.next_method is None:
        return task.execute(context)
    kwargs = dict(request.next_kwargs or {})
    event = kwargs.pop("event", None)
    return getattr(task, request.next_method)(context=context, event=event, **kwargs)


def _deferral(task: BaseOperator, deferred: TaskDeferred, deadline: dt.datetime | None) -> Outcome:
    where = f"task {task.task_id!r}"
    if not isinstance(deferred.trigger, BaseTrigger):
        return Failed(f"{where} deferred to {deferred.trigger!r}, not a BaseTrigger", "", False)
    if not callable(getattr(task, deferred.method_name, None)):
        return Failed(f"{where} deferred to a method it lacks: {deferred.method_name!r}", "", False)
    if deferred.timeout is not None and not isinstance(deferred.timeout, dt.timedelta):
        return Failed(f"{where} deferred with a timeout that is not a timedelta", "", False)
    try:
        classpath, trigger_kwargs = deferred.trigger.serialize()
        checked_trigger = serialization.check_kwargs(trigger_kwargs, "trigger kwargs")
        checked_next = serialization.check_kwargs(deferred.kwargs, "defer kwargs")
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
    )


def execute_attempt(request: AttemptRequest) -> Outcome:
    """Entry point in the child process."""
    try:
        dag = _dagbag().get_dag(request.dag_id)
        task = copy.deepcopy(dag.get_task(request.task_id))
    except Exception as exc:
        return _failed(exc, allow_retry=True)
    deadline = decide.execution_deadline(request.first_started_at, task.execution_timeout)
    try:
        context = _context(request, task)
        _raise_deferral_failure(request)
        with _time_limit(deadline):
            result = _call(task, request, context)
    except TaskDeferred as deferred:
        return _deferral(task, deferred, deadline)
    except SkipTask as exc:
        return Skipped(_one_line(exc))
    except RescheduleTask as exc:
        return Rescheduled(exc.reschedule_date)
    except FailTask as exc:
        return _failed(exc, allow_retry=False)
    except Exception as exc:
        return _failed(exc, allow_retry=True)
    try:
        value = serialization.to_jsonable(result, f"return value of task {task.task_id!r}")
    except SerializationError as exc:
        return Failed(str(exc), "", allow_retry=False)
    return Succeeded(value)
