"""worker.attempt.execute_attempt, run in-process against a DAG file in a temporary folder.

No database is touched: the XCom backend is built (lazily, without connecting) but no task here
calls xcom_push or xcom_pull.
"""

from __future__ import annotations

import datetime as dt
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from deferral.loading import task_runtime
from deferral.loading.dagbag import process_dagbag
from deferral.runtime import serialization
from worker.attempt import execute_attempt
from worker.outcomes import AttemptRequest, Deferred, Failed, Skipped, Succeeded

DAG_ID = "attempt_dag"
MOMENT = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
LOGICAL = dt.datetime(2024, 2, 3, 4, 5, 6, tzinfo=dt.UTC)
SLEEPS_SECONDS = 60  # the "sleeps" task's sleep, cut short by its 0.3 s execution_timeout

DAG_SOURCE = """
import datetime as dt
import time

from deferral import DAG, BaseOperator
from deferral.exceptions import FailTask, SkipTask, TaskDeferred
from deferral.sensors import FileSensor
from deferral.triggers import BaseTrigger, DateTimeTrigger, TriggerEvent

MOMENT = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
SLEEPS_SECONDS = 60


class ConnTrigger(BaseTrigger):
    def __init__(self, conn):
        super().__init__()
        self.conn = conn

    def serialize(self):
        return f"{__name__}.ConnTrigger", {"conn": self.conn}

    async def run(self):
        yield TriggerEvent(None)


class BrokenSerializeTrigger(ConnTrigger):
    def serialize(self):
        raise RuntimeError("serialize exploded")


class Base(BaseOperator):
    def resume(self, context, event=None, **kwargs):
        return {
            "event": event,
            "kwargs": kwargs,
            "had_marker": hasattr(self, "marker"),
            "task_id": context["ti"].task_id,
            "try_number": context["try_number"],
            "params": context["params"],
            "logical_date": context["logical_date"],
        }


class Returns(Base):
    def execute(self, context):
        return {"when": context["logical_date"], "pair": (1, 2), "run": context["run_id"]}


class Raises(Base):
    def execute(self, context):
        raise RuntimeError("kaput\\nsecond line")


class Fails(Base):
    def execute(self, context):
        raise FailTask("no retry please")


class Skips(Base):
    def execute(self, context):
        raise SkipTask("nothing to do")


class DeferBadKwargs(Base):
    def execute(self, context):
        self.defer(
            trigger=DateTimeTrigger(MOMENT), method_name="resume", kwargs={"handle": object()}
        )


class DeferBadTrigger(Base):
    def execute(self, context):
        self.defer(trigger=ConnTrigger(object()), method_name="resume")


class DeferBrokenSerialize(Base):
    def execute(self, context):
        self.defer(trigger=BrokenSerializeTrigger("x"), method_name="resume")


class DeferMissing(Base):
    def execute(self, context):
        self.defer(trigger=DateTimeTrigger(MOMENT), method_name="no_such_method")


class DeferNotATrigger(Base):
    def execute(self, context):
        raise TaskDeferred(trigger="not a trigger", method_name="resume")


class DeferBadTimeout(Base):
    def execute(self, context):
        self.defer(trigger=DateTimeTrigger(MOMENT), method_name="resume", timeout=30)


class Resumable(Base):
    def execute(self, context):
        self.marker = "set before deferring"
        self._deep()

    def _deep(self):
        self.defer(
            trigger=DateTimeTrigger(MOMENT),
            method_name="resume",
            kwargs={"n": 3, "when": MOMENT, "pair": (1, "a")},
            timeout=dt.timedelta(hours=1),
        )


class BadReturn(Base):
    def execute(self, context):
        return {"items": {1, 2}}


class Sleeps(Base):
    def execute(self, context):
        time.sleep(SLEEPS_SECONDS)
        return "woke"


with DAG("attempt_dag", params={"p": 1, "shared": "dag"}) as dag:
    Returns(task_id="returns")
    Raises(task_id="raises")
    Fails(task_id="fails")
    Skips(task_id="skips")
    DeferBadKwargs(task_id="defer_bad_kwargs")
    DeferBadTrigger(task_id="defer_bad_trigger")
    DeferBrokenSerialize(task_id="defer_broken_serialize")
    DeferMissing(task_id="defer_missing")
    DeferNotATrigger(task_id="defer_not_a_trigger")
    DeferBadTimeout(task_id="defer_bad_timeout")
    Resumable(task_id="resumable")
    Resumable(task_id="resumable_limited", execution_timeout=dt.timedelta(minutes=10))
    BadReturn(task_id="bad_return")
    Sleeps(task_id="sleeps", execution_timeout=dt.timedelta(seconds=0.3))
    FileSensor(task_id="sensor", filepath="/nowhere/flag", deferrable=True, retries=3)
    FileSensor(task_id="soft_sensor", filepath="/nowhere/flag", deferrable=True, soft_fail=True)
"""


@pytest.fixture(autouse=True)
def dags_env(attempt_dags: Callable[[str], Path]) -> Path:
    return attempt_dags(DAG_SOURCE)


def request(
    task_id: str,
    *,
    next_method: str | None = None,
    next_kwargs: dict[str, Any] | None = None,
    first_started_at: dt.datetime | None = None,
    dag_id: str = DAG_ID,
    conf: dict[str, Any] | None = None,
    try_number: int = 2,
    max_tries: int = 0,
) -> AttemptRequest:
    return AttemptRequest(
        task_instance_id=41,
        dag_id=dag_id,
        run_id="manual__1",
        task_id=task_id,
        map_index=-1,
        try_number=try_number,
        logical_date=LOGICAL,
        conf={"shared": "conf"} if conf is None else conf,
        first_started_at=first_started_at or dt.datetime.now(dt.UTC),
        next_method=next_method,
        # As the worker sends them: in to_jsonable form (tuples and datetimes tagged).
        next_kwargs=None if next_kwargs is None else serialization.to_jsonable(next_kwargs),
        max_tries=max_tries,
    )


# -- plain outcomes --------------------------------------------------------------------------------


def test_return_value_succeeds_in_jsonable_form() -> None:
    outcome = execute_attempt(request("returns"))
    assert isinstance(outcome, Succeeded)
    assert outcome.return_value == serialization.to_jsonable(
        {"when": LOGICAL, "pair": (1, 2), "run": "manual__1"}
    )
    assert serialization.from_jsonable(outcome.return_value)["pair"] == (1, 2)


def test_exception_fails_with_retry_and_one_line_error() -> None:
    outcome = execute_attempt(request("raises"))
    assert isinstance(outcome, Failed)
    assert outcome.allow_retry is True
    assert outcome.error == "RuntimeError: kaput"
    assert "RuntimeError: kaput" in outcome.traceback
    assert "Traceback" in outcome.traceback


def test_fail_task_fails_without_retry() -> None:
    outcome = execute_attempt(request("fails"))
    assert isinstance(outcome, Failed)
    assert outcome.error == "FailTask: no retry please"
    assert outcome.allow_retry is False


def test_skip_task_skips() -> None:
    assert execute_attempt(request("skips")) == Skipped("SkipTask: nothing to do")


def test_unserializable_return_value_fails_naming_it() -> None:
    outcome = execute_attempt(request("bad_return"))
    assert isinstance(outcome, Failed)
    assert outcome.allow_retry is False
    assert "return value of task 'bad_return'['items']" in outcome.error
    assert "set" in outcome.error


def test_unknown_dag_fails_with_retry() -> None:
    outcome = execute_attempt(request("returns", dag_id="no_such_dag"))
    assert isinstance(outcome, Failed)
    assert outcome.allow_retry is True
    assert outcome.error.startswith("DagNotFound: ")
    assert "no_such_dag" in outcome.error


def test_unknown_task_fails() -> None:
    outcome = execute_attempt(request("no_such_task"))
    assert isinstance(outcome, Failed)
    assert "no_such_task" in outcome.error


# -- deferring -------------------------------------------------------------------------------------


def test_defer_gives_deferred_outcome() -> None:
    before = dt.datetime.now(dt.UTC)
    outcome = execute_attempt(request("resumable"))
    after = dt.datetime.now(dt.UTC)
    assert isinstance(outcome, Deferred)
    assert outcome.classpath == "deferral.triggers.temporal.DateTimeTrigger"
    assert outcome.trigger_kwargs == serialization.check_kwargs({"moment": MOMENT})
    assert outcome.method_name == "resume"
    assert serialization.from_jsonable(outcome.next_kwargs) == {
        "n": 3,
        "when": MOMENT,
        "pair": (1, "a"),
    }
    assert outcome.trigger_timeout is not None
    assert before + dt.timedelta(hours=1) <= outcome.trigger_timeout
    assert outcome.trigger_timeout <= after + dt.timedelta(hours=1)


def test_defer_timeout_capped_by_execution_deadline() -> None:
    started = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=4)
    outcome = execute_attempt(request("resumable_limited", first_started_at=started))
    assert isinstance(outcome, Deferred)
    # Earlier of now + 1h and first start + 10 min.
    assert outcome.trigger_timeout == started + dt.timedelta(minutes=10)


def test_defer_kwarg_holding_object_fails_naming_key_and_type() -> None:
    outcome = execute_attempt(request("defer_bad_kwargs"))
    assert isinstance(outcome, Failed)
    assert outcome.allow_retry is False
    assert "defer kwargs['handle']" in outcome.error
    assert "object" in outcome.error
    assert "'defer_bad_kwargs'" in outcome.error


def test_trigger_kwarg_holding_object_fails_naming_key_and_type() -> None:
    outcome = execute_attempt(request("defer_bad_trigger"))
    assert isinstance(outcome, Failed)
    assert outcome.allow_retry is False
    assert "trigger kwargs['conn']" in outcome.error
    assert "unsupported type object" in outcome.error


def test_defer_to_missing_method_fails_naming_it() -> None:
    outcome = execute_attempt(request("defer_missing"))
    assert isinstance(outcome, Failed)
    assert outcome.allow_retry is False
    assert "'no_such_method'" in outcome.error
    assert "'defer_missing'" in outcome.error


def test_defer_to_non_trigger_fails() -> None:
    outcome = execute_attempt(request("defer_not_a_trigger"))
    assert isinstance(outcome, Failed)
    assert "not a BaseTrigger" in outcome.error


def test_defer_with_non_timedelta_timeout_fails() -> None:
    outcome = execute_attempt(request("defer_bad_timeout"))
    assert isinstance(outcome, Failed)
    assert "timeout" in outcome.error
    assert "timedelta" in outcome.error


def test_trigger_whose_serialize_raises_gives_failed() -> None:
    outcome = execute_attempt(request("defer_broken_serialize"))
    assert isinstance(outcome, Failed)
    assert "serialize exploded" in outcome.error


# -- resuming --------------------------------------------------------------------------------------


def test_malformed_resume_kwargs_fail_the_try_without_retry_naming_them() -> None:
    resuming = request("resumable", next_method="resume", next_kwargs={})
    bad_tag = {"when": {serialization.TAG: "no-such-type"}}
    outcome = execute_attempt(msgspec.structs.replace(resuming, next_kwargs=bad_tag))
    assert isinstance(outcome, Failed) and not outcome.allow_retry
    assert outcome.error.startswith("cannot run: resume kwargs: unknown serialized type tag")


def test_resume_calls_method_with_context_event_and_kwargs_on_fresh_instance() -> None:
    deferred = execute_attempt(request("resumable"))
    assert isinstance(deferred, Deferred)
    event = {"fired_at": MOMENT, "ok": True}
    next_kwargs = {**serialization.from_jsonable(deferred.next_kwargs), "event": event}
    outcome = execute_attempt(
        request("resumable", next_method=deferred.method_name, next_kwargs=next_kwargs)
    )
    assert isinstance(outcome, Succeeded)
    result = serialization.from_jsonable(outcome.return_value)
    assert result["event"] == event
    assert result["kwargs"] == {"n": 3, "when": MOMENT, "pair": (1, "a")}
    assert result["had_marker"] is False  # nothing set on self survives a deferral
    assert result["task_id"] == "resumable"
    assert result["try_number"] == 2
    assert result["logical_date"] == LOGICAL
    assert result["params"] == {"p": 1, "shared": "conf"}  # conf overrides DAG params
    # The operator the DAG file built is untouched as well.
    original = process_dagbag().get_dag(DAG_ID).get_task("resumable")
    assert not hasattr(original, "marker")


def test_resume_without_event_passes_none() -> None:
    outcome = execute_attempt(request("resumable", next_method="resume", next_kwargs=None))
    assert isinstance(outcome, Succeeded)
    assert outcome.return_value["event"] is None
    assert outcome.return_value["kwargs"] == {}


def test_resume_at_missing_method_fails() -> None:
    outcome = execute_attempt(request("resumable", next_method="vanished", next_kwargs={}))
    assert isinstance(outcome, Failed)
    assert "AttributeError" in outcome.error
    assert "vanished" in outcome.error


def test_fail_method_timeout_raises_task_deferral_timeout() -> None:
    outcome = execute_attempt(
        request("resumable", next_method="__fail__", next_kwargs={"error": "timeout"})
    )
    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("TaskDeferralTimeout: ")
    assert "timed out" in outcome.error
    assert outcome.allow_retry is True


def test_a_deferral_cut_short_by_the_execution_deadline_reports_the_deferral_timeout() -> None:
    started = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=11)  # deadline passed a minute ago
    outcome = execute_attempt(
        request(
            "resumable_limited",
            first_started_at=started,
            next_method="__fail__",
            next_kwargs={"error": "timeout"},
        )
    )
    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("TaskDeferralTimeout: ")


def test_fail_method_trigger_failure_raises_task_deferral_error_with_traceback() -> None:
    outcome = execute_attempt(
        request(
            "resumable",
            next_method="__fail__",
            next_kwargs={
                "error": "trigger_failure",
                "message": "trigger blew up",
                "traceback": "Traceback (most recent call last):\nValueError: deep",
            },
        )
    )
    assert isinstance(outcome, Failed)
    assert outcome.error == "TaskDeferralError: trigger blew up"
    assert "ValueError: deep" in outcome.traceback


def test_a_sensor_whose_deferral_timed_out_fails_with_sensor_timeout_and_no_retry() -> None:
    outcome = execute_attempt(
        request("sensor", next_method="__fail__", next_kwargs={"error": "timeout"})
    )
    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("SensorTimeout: sensor 'sensor' timed out")
    assert outcome.allow_retry is False


def test_a_soft_fail_sensor_whose_deferral_timed_out_is_skipped() -> None:
    outcome = execute_attempt(
        request("soft_sensor", next_method="__fail__", next_kwargs={"error": "timeout"})
    )
    assert isinstance(outcome, Skipped)
    assert "timed out" in outcome.reason


# -- execution_timeout -----------------------------------------------------------------------------


def test_execution_timeout_already_passed_fails_before_resuming() -> None:
    started = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=11)
    outcome = execute_attempt(
        request(
            "resumable_limited",
            next_method="resume",
            next_kwargs={"event": "x"},
            first_started_at=started,
        )
    )
    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("TaskExecutionTimeout: ")


def test_execution_timeout_interrupts_a_running_task() -> None:
    started = dt.datetime.now(dt.UTC)
    outcome = execute_attempt(request("sleeps", first_started_at=started))
    elapsed = (dt.datetime.now(dt.UTC) - started).total_seconds()
    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("TaskExecutionTimeout: ")
    # Interrupted, not timed out after the fact: the sleep was cut short. (A bound far above
    # the 0.3 s timeout: a loaded machine must not make this fail, only a missed interrupt.)
    assert elapsed < SLEEPS_SECONDS


def test_no_alarm_left_behind_after_an_attempt() -> None:
    execute_attempt(request("resumable_limited"))
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler, None)


def test_an_attempt_imports_only_its_dags_file(
    dags_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file the scheduler parsed the DAG from (the dag row's fileloc), and no other file
    of the folder (one that never finished importing would stop the task)."""
    dag_file = next(path for path in dags_env.glob("attempt_dag_*.py"))
    marker = dags_env.parent / "imported"
    (dags_env / "a_other.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setattr(task_runtime, "parsed_fileloc", lambda dag_id: str(dag_file.resolve()))
    assert isinstance(execute_attempt(request("returns")), Succeeded)
    assert not marker.exists()
