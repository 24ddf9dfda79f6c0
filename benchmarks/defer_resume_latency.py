"""How long from a trigger's moment to the task running again, through real processes.

Runs scheduler, triggerer and worker (`deferral standalone`'s set) against a throw-away database
and stream prefix, triggers a DAG of N tasks that each defer until the same moment, and prints
latency percentiles from `task_state_change`:

    .venv/bin/python benchmarks/defer_resume_latency.py [--tasks 200]

Uses DEFERRAL_TEST_ADMIN_URL / DEFERRAL_TEST_REDIS_URL like the tests (local servers by default;
see scratch.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scratch import scratch_deployment
from sqlalchemy import select

from deferral.store import transitions
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral_cli.embedded import running_services

DAG = """
import datetime as dt
from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger

MOMENT = dt.datetime.fromisoformat("{moment}")


class WaitForMoment(BaseOperator):
    def execute(self, context):
        self.defer(trigger=DateTimeTrigger(MOMENT), method_name="resume")

    def resume(self, context, event):
        return None


with DAG("bench_defer", max_active_tasks={tasks}) as dag:
    for i in range({tasks}):
        WaitForMoment(task_id=f"t{{i}}")
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--lead", type=float, default=15.0, help="seconds until the moment")
    args = parser.parse_args()

    dags = Path(tempfile.mkdtemp())
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=args.lead)
    (dags / "bench_defer.py").write_text(DAG.format(moment=moment.isoformat(), tasks=args.tasks))
    with scratch_deployment(dags, "bench") as url:
        sessions = make_sessionmaker(make_engine(url))
        with running_services():
            with sessions.begin() as session:
                transitions.create_dag_run(
                    session, "bench_defer", "r1", dt.datetime.now(dt.UTC), {}
                )
            started = time.monotonic()
            while True:
                with sessions() as session:
                    state = session.scalar(select(DagRun.state))
                if state in ("success", "failed"):
                    break
                if time.monotonic() - started > args.lead + 300:
                    sys.exit("benchmark run did not finish")
                time.sleep(0.2)
        with sessions() as session:
            rows = session.execute(
                select(TaskStateChange.to_state, TaskStateChange.reason, TaskStateChange.at).join(
                    TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id
                )
            ).all()
        fired = [
            (r.at - moment).total_seconds()
            for r in rows
            if r.to_state == "scheduled" and (r.reason or "").startswith("trigger")
        ]
        resumed = [(r.at - moment).total_seconds() for r in rows if r.reason == "resumed"]
        done = [(r.at - moment).total_seconds() for r in rows if r.to_state == "success"]
        print(f"run {state}: {args.tasks} tasks deferred until one moment")
        for label, values in [
            ("moment -> deferred->scheduled (event applied)", fired),
            ("moment -> running again (resume picked up)", resumed),
            ("moment -> success", done),
        ]:
            print(
                f"  {label}: p50 {statistics.median(values) * 1000:.0f} ms, "
                f"p95 {percentile(values, 0.95) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms "
                f"(n={len(values)})"
            )


if __name__ == "__main__":
    main()
