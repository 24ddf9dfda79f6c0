"""Waits that compose (issue 33), through real processes: N tasks each wait on
``AnyOf(signal=SignalTrigger(<its key>), timeout=TimeDeltaTrigger(--timeout))``; half are
signalled, half time out into their default.

    .venv/bin/python benchmarks/composite_waits.py [--n 500] [--timeout 10]

Starts a scheduler, a worker and a triggerer (with its metrics port) on a fresh database; runs
one DAG run of a task mapped N ways, each deferring on its composite; then sends the signals of
the even map indexes with ``deferral.signals.send`` (each timed to its commit, which resumes
the task) and waits for every task to succeed. Prints:

- time to all deferred; the triggerer's ``deferral_triggers_running`` before, at its highest
  while they wait, and after (target: unchanged, 0: nothing runs for a composite);
- signal -> SCHEDULED p50 / p99 (the send's call to its commit);
- timer lateness: each timed-out task's deferred -> scheduled change after its moment (the
  scheduler's timer pass runs every second), p50 / max;
- each task resumed exactly once, with the right branch and value.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import urllib.request

from harness import Figure, Stack, percentile, report, wait_for
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from deferral import signals
from deferral.store.xcom import DatabaseXComs
from deferral_cli.embedded import free_port

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import AnyOf, SignalTrigger, TimeDeltaTrigger


class WaitForOrder(BaseOperator):
    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def execute(self, context):
        self.defer(
            trigger=AnyOf(
                signal=SignalTrigger(f"order-{{self.n}}"),
                timeout=TimeDeltaTrigger(dt.timedelta(seconds={timeout})),
            ),
            method_name="done",
        )

    def done(self, context, event):
        if event["fired"] == "timeout":
            return {{"n": self.n, "default": True}}
        return event["payload"]


with DAG("bench_composite", max_active_tasks={n}):
    WaitForOrder.partial(task_id="wait").expand(n=list(range({n})))
"""


def triggers_running(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
        return next(
            s.value for f in families for s in f.samples if s.name == "deferral_triggers_running"
        )


def count(stack: Stack, sql: str) -> int:
    with stack.sessions() as session:
        return int(session.scalar(text(sql)) or 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--timeout", type=float, default=10.0, help="the timer branch, seconds")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--db-prefix", default="deferral_bench")
    args = parser.parse_args()
    # One task mapped N ways: past Airflow's default max_map_length (1,024) it must be raised.
    more = {"DEFERRAL_MAX_MAP_LENGTH": str(max(args.n, 1024))}
    with Stack(heartbeat_sec=1, prefix=args.db_prefix, extra_env=more) as stack:
        os.environ.update({k: stack.env[k] for k in stack.env if k.startswith("DEFERRAL_")})
        port = free_port()
        stack.write_dag("bench_composite", DAG.format(n=args.n, timeout=args.timeout))
        stack.start("scheduler")
        stack.start("worker", "--concurrency", str(args.concurrency))
        stack.start("triggerer", "--metrics-port", str(port))
        stack.wait_started("scheduler", "worker", "triggerer")
        before = wait_for(lambda: _scrape(port), timeout=60, what="the triggerer's metrics")
        started = time.monotonic()
        stack.trigger("bench_composite", ["r1"])
        highest = [before[1]]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                highest.append(triggers_running(port))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wait_for(
            lambda: stack.reached("deferred", "bench_composite") >= args.n or _failed(stack),
            timeout=600,
            what="every task to defer",
        )
        deferred_in = time.monotonic() - started
        latencies = []
        for n in range(0, args.n, 2):
            sent_at = time.perf_counter()
            resumed = signals.send(f"order-{n}", {"n": n, "paid": True}).resumed
            latencies.append((time.perf_counter() - sent_at) * 1000)
            assert len(resumed) == 1, n
        wait_for(
            lambda: (
                count(stack, "SELECT count(*) FROM task_instance WHERE state = 'success'") >= args.n
            ),
            timeout=600,
            what="every task to succeed",
        )
        done.set()
        sampler.join()
        after = triggers_running(port)
        once = count(
            stack,
            "SELECT count(*) FROM (SELECT task_instance_id FROM task_state_change"
            " WHERE from_state = 'deferred' AND to_state = 'scheduled'"
            " GROUP BY task_instance_id HAVING count(*) = 1) AS c",
        )
        with stack.sessions() as session:
            late = [
                r.late
                for r in session.execute(
                    text(
                        "SELECT extract(epoch FROM r.at - d.at) - :timeout AS late"
                        " FROM task_state_change AS d JOIN task_state_change AS r"
                        " ON r.task_instance_id = d.task_instance_id"
                        " AND r.from_state = 'deferred' AND r.to_state = 'scheduled'"
                        " JOIN task_instance AS ti ON ti.id = d.task_instance_id"
                        " WHERE d.to_state = 'deferred' AND ti.map_index % 2 = 1"
                    ),
                    {"timeout": args.timeout},
                )
            ]
        xcoms = DatabaseXComs(stack.sessions)
        wrong = [
            n
            for n in range(args.n)
            if xcoms.pull("bench_composite", "r1", "wait", "return_value", n)
            != ({"n": n, "paid": True} if n % 2 == 0 else {"n": n, "default": True})
        ]
    met = report(
        f"Composite waits: {args.n} tasks on AnyOf(signal | {args.timeout:g} s timer),"
        " half signalled, half timed out",
        [
            Figure("time to all deferred", deferred_in, "s"),
            Figure("triggers running before", before[1], "triggers"),
            Figure("triggers running at most while they wait", max(highest), "triggers", 0),
            Figure("triggers running after", after, "triggers", 0),
            Figure("signal -> SCHEDULED p50", percentile(latencies, 0.5), "ms"),
            Figure("signal -> SCHEDULED p99", percentile(latencies, 0.99), "ms"),
            Figure("timer lateness p50 (moment -> SCHEDULED)", percentile(late, 0.5), "s"),
            Figure("timer lateness max", max(late), "s", 2.0),
            Figure("tasks resumed exactly once", once, "tasks", args.n, at_most=False),
            Figure("tasks with a wrong branch or value", len(wrong), "tasks", 0),
        ],
    )
    raise SystemExit(0 if met else 1)


def _failed(stack: Stack) -> bool:
    if stack.reached("failed", "bench_composite"):
        raise SystemExit(f"benchmark: a task failed:\n{stack.log('worker')[-3000:]}")
    return False


def _scrape(port: int) -> tuple[bool, float] | None:
    try:
        return True, triggers_running(port)
    except OSError:
        return None


if __name__ == "__main__":
    main()
