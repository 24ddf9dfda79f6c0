"""``--metrics-port`` on every service: scraped during a deferral and after it, the counters move;
a port that cannot be bound stops the service with one line."""

from __future__ import annotations

import functools
import socket
import subprocess
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.store.tables import TaskInstance, Trigger
from deferral_cli.embedded import free_port
from tests.e2e.conftest import CLI, Services, command
from tests.helpers import metrics_answer, wait_for

pytestmark = pytest.mark.e2e

DAG_SOURCE = """
import datetime as dt

from deferral import DAG
from deferral.operators import EmptyOperator
from deferral.sensors import TimeDeltaSensorAsync

with DAG("e2e_metrics") as dag:
    TimeDeltaSensorAsync(task_id="wait", delta=dt.timedelta(seconds=3)) >> EmptyOperator(
        task_id="after"
    )
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _scrape_when_up(port: int) -> Samples | None:
    try:
        return scrape(port)
    except OSError:
        return None  # not listening yet


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _state(sessions: sessionmaker[Session], task_id: str) -> str | None:
    with sessions() as session:
        return session.scalar(select(TaskInstance.state).where(TaskInstance.task_id == task_id))


def _runner(sessions: sessionmaker[Session]) -> str | None:
    """The triggerer the trigger row says runs it."""
    with sessions() as session:
        return session.scalars(select(Trigger.triggerer_id)).one()


def test_each_service_serves_metrics_that_move_with_a_deferral(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    write_dag("e2e_metrics_dag", DAG_SOURCE)
    ports = {name: free_port() for name in ("scheduler", "worker", "triggerer")}
    services.start("scheduler", "--metrics-port", str(ports["scheduler"]))
    services.start(
        "worker", "--concurrency", "2", env={"DEFERRAL_METRICS_PORT": str(ports["worker"])}
    )
    services.start("triggerer", "--metrics-port", str(ports["triggerer"]))
    before = {}
    for name, port in ports.items():
        # Once the service is up: its metrics port answers a moment before its gauges are set.
        services.wait_up(name)
        before[name] = wait_for(functools.partial(_scrape_when_up, port), what=f"{name} /metrics")
    # Once a service reads its stream: the counters of that stream and of each reason at 0 (an
    # alert on their rise sees the first one); build info from the start.
    triggers, events = broker.keys.triggers, broker.keys.events
    for name, stream in (("triggerer", triggers), ("scheduler", events)):
        dead = ("deferral_dead_letters_total", frozenset({"stream": stream}.items()))
        shown = wait_for(
            lambda port=ports[name], key=dead: key in scrape(port),
            what=f"the {name}'s dead letters of {stream}",
        )
        assert shown and scrape(ports[name])[dead] == 0
    user_action = frozenset({"reason": "user_action"}.items())
    assert before["triggerer"][("deferral_triggers_cancelled_total", user_action)] == 0
    for samples in before.values():
        assert [labels for name, labels in samples if name == "deferral_build_info"]
    services.parsed("e2e_metrics")  # what `dags trigger` reads
    waiter = subprocess.Popen(
        command("deferral", "dags", "trigger", "e2e_metrics", "--wait", "--timeout", "90"),
        env=services.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    # -- during the deferral ---------------------------------------------------------------------
    wait_for(lambda: _state(sessions, "wait") == "deferred", timeout=60, what="the sensor to defer")
    during = wait_for(
        lambda: (
            (s := scrape(ports["triggerer"])) and value(s, "deferral_triggers_running") == 1 and s
        ),
        what="the triggerer to run the trigger",
    )
    # The global gauges come from the scheduler only.
    streams = wait_for(
        lambda: (
            (s := scrape(ports["scheduler"]))
            and value(s, "deferral_stream_pending", stream=triggers, group="triggerers") == 1
            and s
        ),
        what="the scheduler to see the trigger entry held",
    )
    assert value(streams, "deferral_stream_length", stream=triggers) == 1
    trigger_class = "deferral.triggers.temporal.DateTimeTrigger"
    assert value(streams, "deferral_deferred_tasks", trigger_class=trigger_class) == 1
    assert not [name for name, _ in during if name.startswith("deferral_stream_")]
    wait_for(lambda: _runner(sessions) is not None, what="the triggerer to record the trigger")
    capacity = value(before["triggerer"], "deferral_triggerer_capacity_left")
    assert value(during, "deferral_triggerer_capacity_left") == capacity - 1
    worker = scrape(ports["worker"])
    assert value(worker, "deferral_task_attempts_total", outcome="deferred") == 1
    assert value(worker, "deferral_worker_slots_free") == 2

    out, _ = waiter.communicate(timeout=90)
    assert waiter.returncode == 0, out

    # -- after: each service's counters moved ----------------------------------------------------
    triggerer, scheduler = scrape(ports["triggerer"]), scrape(ports["scheduler"])
    worker = scrape(ports["worker"])
    assert value(triggerer, "deferral_triggers_fired_total") == 1
    assert value(triggerer, "deferral_triggers_running") == 0
    assert value(triggerer, "deferral_triggerer_loop_lag_seconds_count") > value(
        before["triggerer"], "deferral_triggerer_loop_lag_seconds_count"
    )
    assert value(triggerer, "deferral_lease_renewals_total", stream=triggers) >= 1
    assert value(scheduler, "deferral_events_total", outcome="applied") == 1
    assert value(scheduler, "deferral_resume_latency_seconds_count") == 1
    assert 0 < value(scheduler, "deferral_resume_latency_seconds_sum") < 10
    assert value(scheduler, "deferral_dispatches_total") == 3  # wait, wait resumed, after
    assert value(worker, "deferral_task_attempts_total", outcome="success") == 2
    assert value(worker, "deferral_task_attempts_total", outcome="deferred") == 1
    assert value(worker, "process_resident_memory_bytes") > 0
    assert value(scheduler, "deferral_stream_pending", stream=triggers, group="triggerers") == 0
    for samples in (triggerer, scheduler, worker):
        assert value(samples, "deferral_loop_iteration_timestamp_seconds") > 0
        spaced = [dict(labels) for _, labels in samples if any(" " in v for _, v in labels)]
        assert not spaced, spaced


def test_a_metrics_port_in_use_stops_the_service_with_one_line(services: Services) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for service in ("scheduler", "worker", "triggerer"):
            args = ["consume", "--metrics-port", str(port)]
            done = CLI.run(args, services.env, timeout=60, script=service)
            assert done.returncode == 2, (service, done.stderr)
            assert done.stderr.strip() == f"error: --metrics-port {port}: Address already in use"


def test_every_service_binds_its_metrics_where_told(services: Services) -> None:
    """Loopback by default; ``--metrics-host`` (or DEFERRAL_METRICS_HOST) elsewhere. 127.0.0.2 is
    this machine as well: a server on every interface would answer on both addresses."""
    default, told, by_env = free_port(), free_port(), free_port()
    services.start("scheduler", "--metrics-port", str(default))
    services.start("worker", "--metrics-port", str(told), "--metrics-host", "127.0.0.2")
    services.start(
        "triggerer", "--metrics-port", str(by_env), env={"DEFERRAL_METRICS_HOST": "127.0.0.2"}
    )
    wait_for(lambda: metrics_answer("127.0.0.1", default), timeout=60, what="scheduler metrics")
    wait_for(lambda: metrics_answer("127.0.0.2", told), timeout=60, what="worker metrics")
    wait_for(lambda: metrics_answer("127.0.0.2", by_env), timeout=60, what="triggerer metrics")
    assert not metrics_answer("127.0.0.2", default)
    assert not metrics_answer("127.0.0.1", told)
    assert not metrics_answer("127.0.0.1", by_env)
