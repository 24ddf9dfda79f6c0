"""Recording what attempts ended with, through ``deferral.store.transitions``: the worker's batches
and
the in-process runs of ``deferral dags test`` write outcomes the same way."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from deferral import signals
from deferral.runtime import clock, serialization
from deferral.runtime.crypto import Cipher, Purpose
from deferral.runtime.serialization import SerializationError
from deferral.store import far_timers, hitl, transitions, waits
from deferral.store.transitions import Attempt
from worker.outcomes import (
    AttemptRequest,
    AwaitingInput,
    Deferred,
    Failed,
    Rescheduled,
    Skipped,
    Succeeded,
)


def request_of(
    started: transitions.Started, next_kwargs: dict[str, Any] | None, task_log_max_bytes: int
) -> AttemptRequest:
    """What the attempt that ``start_many`` moved to running needs to run (its run exists)."""
    assert started.logical_date is not None
    return AttemptRequest(
        task_instance_id=started.id,
        dag_id=started.dag_id,
        run_id=started.run_id,
        task_id=started.task_id,
        map_index=started.map_index,
        try_number=started.try_number,
        logical_date=started.logical_date,
        conf=dict(started.conf or {}),
        first_started_at=started.first_started_at,
        next_method=started.next_method,
        next_kwargs=next_kwargs,
        max_tries=started.max_tries,
        data_interval_start=started.data_interval_start,
        data_interval_end=started.data_interval_end,
        run_type=started.run_type or "manual",
        partition_key=started.partition_key,
        task_log_max_bytes=task_log_max_bytes,
        clock_correction_sec=clock.correction_sec(),
    )


def resume_kwargs(
    cipher: Cipher, next_kwargs: str | None, next_event: str | None
) -> dict[str, Any] | None:
    """What a resumed attempt's method gets, opened as far as to_jsonable form (the task process
    restores the values: the pipe carries JSON): the sealed kwargs it deferred with, and the
    sealed event its trigger fired, carried beside them, as ``event``. None: not a resume."""
    if next_kwargs is None and next_event is None:
        return None
    kwargs = (
        serialization.decode(cipher.decrypt(Purpose.RESUME_KWARGS, next_kwargs))
        if next_kwargs
        else {}
    )
    if not isinstance(kwargs, dict):
        raise SerializationError(f"resume kwargs are a {type(kwargs).__name__}, not a mapping")
    if next_event:
        kwargs = {
            **kwargs,
            "event": serialization.decode(cipher.decrypt(Purpose.EVENT, next_event)),
        }
    return kwargs


def succeed_all(
    session: Session,
    cipher: Cipher,
    successes: Sequence[tuple[Attempt, Succeeded]],
    *,
    said: str | None = None,
) -> set[int]:
    """running -> success for each attempt, skipping the tasks each chose not to run, and the
    tasks waiting on the asset events they recorded resumed; returns the task instances that
    moved. ``said``: the worker's line for the log of each try that moved, written with the
    move."""
    succeeded, events = transitions.succeed_recording(
        session, [(a, o.return_value) for a, o in successes], said=said
    )
    for attempt, success in successes:
        if attempt.task_instance_id in succeeded and success.skip_task_ids:
            transitions.skip_tasks(session, attempt.task_instance_id, success.skip_task_ids)
        if attempt.task_instance_id in succeeded and success.outlet_extras:
            transitions.annotate_outlet_events(
                session, attempt.task_instance_id, success.outlet_extras
            )
        if attempt.task_instance_id in succeeded and success.alias_events:
            events += transitions.record_alias_events(
                session, attempt.task_instance_id, success.alias_events
            )
        if attempt.task_instance_id in succeeded and success.outlet_partitions:
            transitions.partition_outlet_events(
                session, attempt.task_instance_id, success.outlet_partitions
            )
    waits.resume_asset_waiters(session, cipher, events)
    return succeeded


def deferral_of(
    attempt: Attempt, outcome: Deferred, cipher: Cipher, horizon: dt.timedelta | None = None
) -> transitions.Deferral:
    """The trigger row and resume point a deferral writes, its kwargs sealed; a time trigger
    due beyond ``horizon`` from now waits as a row (None: every trigger is published now)."""
    far_moment = (
        None
        if horizon is None
        else far_timers.far_moment(
            outcome.classpath, outcome.trigger_kwargs, dt.datetime.now(dt.UTC), horizon
        )
    )
    return transitions.Deferral(
        attempt=attempt,
        classpath=outcome.classpath,
        kwargs_token=cipher.encrypt(
            Purpose.TRIGGER_KWARGS, serialization.encode(outcome.trigger_kwargs)
        ),
        next_method=outcome.method_name,
        next_kwargs_token=cipher.encrypt(
            Purpose.RESUME_KWARGS, serialization.encode(outcome.next_kwargs)
        ),
        trigger_timeout=outcome.trigger_timeout,
        share_key=(
            transitions.share_key(cipher, outcome.classpath, outcome.trigger_kwargs)
            if outcome.shared
            else None
        ),
        far_moment=far_moment,
    )


def wait_of(attempt: Attempt, outcome: Deferred) -> signals.Wait | None:
    """What of a deferral is held as rows (``signals.wait_of``): a signal or callback wait, a
    composite's branches, a cancel-on."""
    return signals.wait_of(
        outcome.classpath,
        outcome.trigger_kwargs,
        attempt.task_instance_id,
        attempt.try_number,
        outcome.cancel_on,
        outcome.cancel_state,
    )


def apply_other(
    session: Session, attempt: Attempt, outcome: Rescheduled | Skipped | Failed | AwaitingInput
) -> tuple[bool, str]:
    """Record a reschedule, skip, failure or request for input; returns whether it moved the task
    and what to say of it in the try's log."""
    if isinstance(outcome, AwaitingInput):
        return await_input(session, attempt, outcome), f"awaiting input: {outcome.subject}"
    if isinstance(outcome, Rescheduled):
        moved = transitions.reschedule(session, attempt, outcome.reschedule_date)
        return moved, f"pokes again at {outcome.reschedule_date}"
    if isinstance(outcome, Skipped):
        return transitions.skip(session, attempt, outcome.reason), f"skipped: {outcome.reason}"
    state = transitions.fail(
        session,
        attempt,
        outcome.error,
        allow_retry=outcome.allow_retry,
        retry_delay=outcome.retry_delay,
    )
    said = f"failed, now {state}: {outcome.error}\n{outcome.traceback}".rstrip()
    return state is not None, said


def await_input(session: Session, attempt: Attempt, outcome: AwaitingInput) -> bool:
    """running -> awaiting_input, the request stored with it."""
    if not transitions.await_input(session, attempt):
        return False
    request = hitl.InputRequest(
        subject=outcome.subject,
        body=outcome.body,
        options=outcome.options,
        defaults=outcome.defaults,
        multiple=outcome.multiple,
        params=outcome.params,
        timeout=outcome.timeout,
    )
    hitl.record_request(session, attempt.task_instance_id, attempt.try_number, request)
    return True
