"""The whole loop through real processes: worker defers -> triggerer fires -> scheduler resumes ->
worker runs the resume method on a fresh instance -> downstream runs."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import GROUP_SCHEDULERS, GROUP_TRIGGERERS, GROUP_WORKERS
from deferral.runtime.crypto import Cipher, Purpose
from deferral.store.tables import DagRun, ResumeEvent, TaskInstance, TaskStateChange, Trigger
from deferral.store.xcom import DatabaseXComs
from tests.e2e.conftest import Services, command
from tests.helpers import redis_cli_target, wait_for
from triggerer.events import event_message

pytestmark = pytest.mark.e2e

SECRET = "s3cr3t-api-key-4242"

DEFER_DAG = f'''
import datetime as dt
import time

from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger


class DeferOnce(BaseOperator):
    def execute(self, context):
        self.marker = "set before deferring"
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=2)),
            method_name="resume",
            kwargs={{
                "api_key": "{SECRET}",
                "started": dt.datetime.now(dt.UTC),
                "window": dt.timedelta(minutes=5),
            }},
        )

    def resume(self, context, event, api_key, started, window):
        return {{
            "saw_marker": hasattr(self, "marker"),
            "event": event,
            "api_key": api_key,
            "started": started,
            "window": window,
            "run_id": context["run_id"],
        }}


def independent():
    time.sleep(0.3)
    return "independent done"


def after(ti):
    return ti.xcom_pull(task_ids="first")["api_key"]


with DAG("e2e_defer") as dag:
    first = DeferOnce(task_id="first", priority_weight=10)
    first >> PythonOperator(task_id="after", python_callable=after)
    PythonOperator(task_id="independent", python_callable=independent, priority_weight=1)
'''


def _ti(sessions: sessionmaker[Session], task_id: str) -> TaskInstance | None:
    with sessions() as session:
        return session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).first()


def _changes(sessions: sessionmaker[Session], task_id: str) -> list[TaskStateChange]:
    with sessions() as session:
        return list(
            session.scalars(
                select(TaskStateChange)
                .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
                .where(TaskInstance.task_id == task_id)
                .order_by(TaskStateChange.id)
            )
        )


def _at(changes: list[TaskStateChange], from_state: str, to_state: str) -> dt.datetime:
    return next(c.at for c in changes if (c.from_state, c.to_state) == (from_state, to_state))


def _assert_streams_drained(broker: Broker) -> None:
    """Every stream under the prefix holds no entry and no group has anything pending."""
    keys = broker.keys
    for stream, group in [
        *((triggers, GROUP_TRIGGERERS) for triggers in keys.triggers_of("default")),
        *((events, GROUP_SCHEDULERS) for events in keys.all_events),
        (keys.queue("default"), GROUP_WORKERS),
    ]:
        assert broker.pending(stream, group).count == 0, stream
        assert broker.redis.xlen(stream) == 0, stream
    assert broker.redis.xlen(keys.dead) == 0


def _start_all(services: Services, concurrency: int = 1, *triggerer_args: str) -> None:
    services.start("scheduler")
    services.start("worker", "--concurrency", str(concurrency))
    services.start("triggerer", *triggerer_args)


def test_task_defers_frees_its_slot_and_resumes_on_a_fresh_instance(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    cipher: Cipher,
    service_env: dict[str, str],
) -> None:
    write_dag("e2e_defer_dag", DEFER_DAG)
    _start_all(services, concurrency=1)
    services.parsed("e2e_defer")  # what `dags trigger` reads
    waiter = subprocess.Popen(
        command("deferral", "dags", "trigger", "e2e_defer", "--wait", "--timeout", "90"),
        env=services.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    # -- during the wait: the stream entry is readable, and nothing secret is in clear ----------
    first = wait_for(
        lambda: (ti := _ti(sessions, "first")) and ti.state == "deferred" and ti,
        timeout=60,
        what="the first task to defer",
    )
    stream = broker.keys.trigger_stream("default", first.trigger_id)  # its shard's
    entries = wait_for(lambda: broker.xrange(stream), what="the trigger entry")
    redis_cli = shutil.which("redis-cli")
    assert redis_cli, "redis-cli is needed (Debian package redis-tools)"
    shown = subprocess.run(
        [
            redis_cli,
            *redis_cli_target(service_env["DEFERRAL_REDIS_URL"]),
            "XRANGE",
            stream,
            "-",
            "+",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with sessions() as session:
        trigger = session.get(Trigger, first.trigger_id)
        assert trigger is not None
        moment = cipher.open(Purpose.TRIGGER_KWARGS, trigger.kwargs)["moment"]
    for field in ("trigger_id", "classpath", "task", "token"):
        assert field in shown
    assert "deferral.triggers.temporal.TimeDeltaTrigger" in shown
    assert f"e2e_defer.{first.run_id}.first" in shown
    assert SECRET not in shown and moment.isoformat() not in shown
    assert len(entries) == 1 and entries[0].fields[b"trigger_id"] == str(first.trigger_id).encode()
    assert trigger.kwargs.startswith("gAAAAA") and first.next_kwargs
    assert first.next_kwargs.startswith("gAAAAA") and SECRET not in first.next_kwargs
    assert (
        cipher.open(Purpose.RESUME_KWARGS, first.next_kwargs)["api_key"] == SECRET
    )  # ...yet it is really in there

    out, _ = waiter.communicate(timeout=90)
    assert waiter.returncode == 0, out

    # -- the first task's whole life ---------------------------------------------------------------
    changes = _changes(sessions, "first")
    assert [c.to_state for c in changes] == [
        "scheduled",
        "queued",
        "running",
        "deferred",
        "scheduled",
        "queued",
        "running",
        "success",
    ]

    # -- the independent task used the single slot while the first was deferred --------------------
    deferred_at = _at(changes, "running", "deferred")
    resumed_at = _at(changes, "deferred", "scheduled")
    independent = _changes(sessions, "independent")
    assert deferred_at < _at(independent, "queued", "running")
    assert _at(independent, "running", "success") < resumed_at

    # -- the resume method saw kwargs and event, on a fresh instance -------------------------------
    run_id = first.run_id
    xcoms = DatabaseXComs(sessions)
    result = xcoms.pull("e2e_defer", run_id, "first", "return_value", -1)
    assert result["saw_marker"] is False
    assert result["api_key"] == SECRET
    assert result["event"] == moment
    assert isinstance(result["started"], dt.datetime) and result["started"].tzinfo is not None
    assert result["window"] == dt.timedelta(minutes=5)
    assert result["run_id"] == run_id

    # -- downstream ran after, and the run finished ------------------------------------------------
    after = _changes(sessions, "after")
    assert [c.to_state for c in after][-1] == "success"
    assert _at(after, "queued", "running") > _at(changes, "running", "success")
    assert xcoms.pull("e2e_defer", run_id, "after", "return_value", -1) == SECRET
    with sessions() as session:
        assert session.scalar(select(DagRun.state)) == "success"

    _assert_streams_drained(broker)


ONE_DEFER_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=3)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_dup") as dag:
    Wait(task_id="wait")
"""


def test_duplicate_fired_events_resume_the_task_once(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    cipher: Cipher,
) -> None:
    """The same fired event is published twice (plus the triggerer's own copy): one resume."""
    write_dag("e2e_dup_dag", ONE_DEFER_DAG)
    # A long heartbeat: the triggerer must not notice the early resume (and drop its trigger as
    # superseded) before it fires its own copy of the event.
    _start_all(services, 1, "--heartbeat", "30")
    assert services.run("dags", "trigger", "e2e_dup").returncode == 0
    waiting = wait_for(
        lambda: (ti := _ti(sessions, "wait")) and ti.state == "deferred" and ti,
        timeout=60,
        what="the task to defer",
    )
    with sessions() as session:
        trigger = session.get(Trigger, waiting.trigger_id)
        assert trigger is not None and waiting.trigger_id is not None
        moment = cipher.open(Purpose.TRIGGER_KWARGS, trigger.kwargs)["moment"]
    # Exactly the event the trigger will fire, published early and twice.
    duplicate = event_message(cipher, waiting.trigger_id, moment, "test")
    broker.publish(broker.keys.events, duplicate)
    broker.publish(broker.keys.events, duplicate)

    wait_for(
        lambda: (ti := _ti(sessions, "wait")) and ti.state == "success",
        timeout=60,
        what="the task to succeed",
    )
    # The triggerer still fires its own copy (same dedup key) when the moment comes; the entry
    # is retired in the call that publishes it.
    wait_for(
        lambda: (
            " fired: " in services.log("triggerer") and broker.redis.xlen(broker.keys.triggers) == 0
        ),
        timeout=30,
        what="the real event",
    )
    wait_for(
        lambda: (
            broker.redis.xlen(broker.keys.events) == 0
            and broker.pending(broker.keys.events, GROUP_SCHEDULERS).count == 0
        ),
        what="every event copy to be consumed",
    )
    changes = _changes(sessions, "wait")
    assert [(c.from_state, c.to_state) for c in changes].count(("deferred", "scheduled")) == 1
    assert [c.to_state for c in changes][-1] == "success"
    with sessions() as session:
        rows = session.execute(select(ResumeEvent.dedup_key, ResumeEvent.outcome)).all()
    assert [(r.dedup_key, r.outcome) for r in rows] == [(duplicate.dedup_key, "applied")]
    _assert_streams_drained(broker)
