"""N tasks deferred on one moment, through real processes: how fast they defer, and how fast
they are all resumed and finished once the moment comes.

    .venv/bin/python benchmarks/resume_throughput.py --n 10000
    .venv/bin/python benchmarks/resume_throughput.py --n 10000 --tasks-per-run 10000
    .venv/bin/python benchmarks/resume_throughput.py --n 10000 --tasks-per-run 10000 --mapped
    .venv/bin/python benchmarks/resume_throughput.py --n 10000 --redis-cluster
    .venv/bin/python benchmarks/resume_throughput.py --n 10000 --redis-cluster --stream-shards 1
    .venv/bin/python benchmarks/resume_throughput.py --n 10000 --redis-cluster --distinct-triggers

Starts schedulers, workers and triggerers (``consume`` console scripts) on a fresh database and
stream prefix, triggers runs of a DAG whose tasks each defer on a ``DateTimeTrigger`` at the same
moment, and reads every figure from ``task_state_change`` (Postgres's clock):

- deferrals per second: N / (first task picked up -> last task deferred);
- fire -> SCHEDULED p50 / p99: the moment -> each task's deferred -> scheduled change;
- all SCHEDULED, all SUCCESS: the moment -> the last task's change;
- with ``--rows``: rows PostgreSQL inserted / updated / deleted (per table), commits and WAL bytes
  per task, deferring (triggered -> the moment) and resuming (the moment -> all succeeded).

The moment is ``--lead`` seconds after the services have started (by default long enough for the
deferrals at a few hundred per second); the benchmark says so if some trigger was not held yet.
``--redis-cluster`` runs it on a Redis Cluster of 3 primaries and 3 replicas on loopback ports,
started for the run (``tests/redis_topologies.py``) instead of the test Redis.
"""

from __future__ import annotations

import argparse
import datetime as dt
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from harness import (
    CpuMeter,
    Figure,
    Profiles,
    RedisMeter,
    RowMeter,
    Stack,
    median,
    percentile,
    report,
    resumed_by_trigger,
    rss_kib,
    wait_for,
)

from tests.redis_topologies import LocalCluster
from tests.servers import REDIS_URL

OPERATOR = """
import datetime as dt
from pathlib import Path

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger

# Written by the benchmark once every service is up, so that start-up time does not eat the lead.
MOMENT_FILE = Path(__file__).with_name("moment.txt")


class WaitForMoment(BaseOperator):
    def __init__(self, *, index=None, **kwargs):
        super().__init__(**kwargs)
        self.index = index

    def execute(self, context):
        moment = dt.datetime.fromisoformat(MOMENT_FILE.read_text())
        if {distinct}:  # a trigger of its own, a microsecond apart, instead of one shared by all
            apart = int(self.task_id.lstrip("t") or 0) + (self.index or 0)
            moment += dt.timedelta(microseconds=apart)
        self.defer(trigger=DateTimeTrigger(moment), method_name="resume")

    def resume(self, context, event):
        return None
"""

DAG = (
    OPERATOR
    + """

with DAG("bench_throughput", max_active_tasks={per_run}, max_active_runs={runs}) as dag:
    for i in range({per_run}):
        WaitForMoment(task_id=f"t{{i}}")
"""
)

# The shape of Airflow's own deferral benchmark: one task mapped over the run's tasks.
MAPPED_DAG = (
    OPERATOR
    + """

with DAG("bench_throughput", max_active_tasks={per_run}, max_active_runs={runs}) as dag:
    WaitForMoment.partial(task_id="t").expand(index=list(range({per_run})))
"""
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="tasks deferred on one moment")
    parser.add_argument("--tasks-per-run", type=int, default=1000, help="tasks in each DAG run")
    parser.add_argument(
        "--mapped", action="store_true", help="each run is one task mapped over its tasks"
    )
    parser.add_argument("--lead", type=float, help="seconds from triggering to the moment")
    parser.add_argument("--schedulers", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=16, help="slots per worker")
    parser.add_argument("--triggerers", type=int, default=1)
    parser.add_argument("--pool-slots", type=int, help="default_pool slots (product default 128)")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--profile", action="store_true", help="py-spy every service, per phase")
    parser.add_argument("--cpu", action="store_true", help="with --profile: only GIL-held samples")
    parser.add_argument(
        "--rows", action="store_true", help="rows written, commits and WAL bytes per task"
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        help="on a local Redis Cluster of 3 primaries and 3 replicas started for the run",
    )
    parser.add_argument(
        "--distinct-triggers",
        action="store_true",
        help="a trigger per task (moments a microsecond apart), so that they spread over shards",
    )
    parser.add_argument(
        "--stream-shards",
        type=int,
        help="DEFERRAL_STREAM_SHARDS (default: the URL's, 1 on one Redis, 16 on a cluster)",
    )
    args = parser.parse_args()
    with ExitStack() as servers:
        redis_url = REDIS_URL
        if args.redis_cluster:
            cluster = LocalCluster(Path(servers.enter_context(tempfile.TemporaryDirectory())))
            servers.callback(cluster.stop)
            redis_url = cluster.start().url
        run(args, redis_url)


def run(args: argparse.Namespace, redis_url: str) -> None:
    per_run = min(args.tasks_per_run, args.n)
    runs = -(-args.n // per_run)
    n = runs * per_run
    lead = args.lead if args.lead is not None else 30.0 + n / 250

    with Stack(
        keep=args.keep_logs,
        max_map_length=per_run,
        redis_url=redis_url,
        stream_shards=args.stream_shards,
    ) as stack:
        if args.pool_slots is not None:
            stack.set_pool_slots("default_pool", args.pool_slots)
        source = MAPPED_DAG if args.mapped else DAG
        stack.write_dag(
            "bench_throughput",
            source.format(per_run=per_run, runs=runs, distinct=args.distinct_triggers),
        )
        names = start_services(stack, args, capacity=-(-n // args.triggerers))
        moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=lead)
        (stack.dags / "moment.txt").write_text(moment.isoformat())
        cpu = CpuMeter(stack)
        redis_cpu = RedisMeter(stack)
        rows = RowMeter(stack) if args.rows else None
        profiled = names if args.profile else []
        with Profiles(stack, profiled, label="deferring", cpu_only=args.cpu) as deferring_profile:
            cpu.start()
            redis_cpu.start()
            if rows:
                rows.start()
            stack.trigger("bench_throughput", [f"r{i}" for i in range(runs)])
            print(f"{n} tasks in {runs} run(s); moment in {lead:.0f} s", flush=True)
            triggers = wait_until_held(stack, n, moment)
            triggerer_rss = [
                rss_kib(stack.procs[name].pid) for name in names if "triggerer" in name
            ]
            cpu.stop()
            redis_cpu.stop()
            deferring = cpu.lines(n, "deferral") + redis_cpu.lines(n, "deferral")
        wait_for(lambda: time.time() >= moment.timestamp(), timeout=lead, what="the moment")
        row_lines: list[str] = []
        if rows:  # the deferrals' counters were reported while the triggers waited
            rows.stop(settle=False)
            row_lines += [f"deferring: {line}" for line in rows.lines(n, "task")]
            rows.start()
        with Profiles(stack, profiled, label="resuming", cpu_only=args.cpu) as resuming_profile:
            cpu.start()
            redis_cpu.start()
            wait_for(
                lambda: stack.states().get("success", 0) >= n,
                timeout=900,
                interval=0.5,
                what=f"{n} tasks to succeed",
            )
            cpu.stop()
            redis_cpu.stop()
            resuming = cpu.lines(n, "resumed task") + redis_cpu.lines(n, "resumed task")
        if rows:
            rows.stop()
            row_lines += [f"resuming: {line}" for line in rows.lines(n, "task")]
        changes = stack.changes("bench_throughput")
        if args.profile:  # before the stack's folder (the raw profiles in it) is removed
            print(deferring_profile.summary())
            print(resuming_profile.summary())

    picked = [c.at for c in changes if c.to_state == "running" and c.reason == "picked up"]
    deferred = [c.at for c in changes if c.to_state == "deferred"]
    scheduled = [(c.at - moment).total_seconds() for c in changes if resumed_by_trigger(c)]
    succeeded = [(c.at - moment).total_seconds() for c in changes if c.to_state == "success"]
    deferral_window = (max(deferred) - min(picked)).total_seconds()
    ok = report(
        f"resume_throughput: {n} tasks deferred on one moment ({runs} run(s) of {per_run}"
        f"{', one task mapped' if args.mapped else ''};"
        f" {args.schedulers} scheduler(s), {args.workers} worker(s) x {args.concurrency} slots,"
        f" {args.triggerers} triggerer(s)"
        f"{'; Redis Cluster of 3 primaries and 3 replicas' if args.redis_cluster else ''};"
        f" {stack.broker.keys.shards} stream shard(s))",
        [
            Figure("deferrals per second", n / deferral_window, "/s", 1000, at_most=False),
            Figure("fire -> SCHEDULED p50", median(scheduled) * 1000, "ms"),
            Figure("fire -> SCHEDULED p99", percentile(scheduled, 0.99) * 1000, "ms"),
            Figure(f"all {n} SCHEDULED after the moment", max(scheduled), "s", 2.0),
            Figure("fire -> SUCCESS p50", median(succeeded), "s"),
            Figure(f"all {n} SUCCESS after the moment", max(succeeded), "s", 20.0),
        ],
        notes=[
            f"deferrals took {deferral_window:.1f} s (first picked up -> last deferred)",
            f"the {n} tasks waited on {triggers} trigger row(s) (shared triggers); triggerer"
            f" RSS at the moment {', '.join(f'{kib / 1024:.0f} MiB' for kib in triggerer_rss)}",
            *(f"deferring: {line}" for line in deferring),
            *(f"resuming: {line}" for line in resuming),
            *row_lines,
        ],
    )
    raise SystemExit(0 if ok else 1)


def start_services(stack: Stack, args: argparse.Namespace, capacity: int) -> list[str]:
    names = [f"scheduler{i}" for i in range(1, args.schedulers + 1)]
    for i in range(1, args.workers + 1):
        stack.start(f"worker{i}", "--concurrency", str(args.concurrency))
        names.append(f"worker{i}")
    for i in range(1, args.triggerers + 1):
        stack.start(f"triggerer{i}", "--capacity", str(capacity))
        names.append(f"triggerer{i}")
    for name in names:
        if name.startswith("scheduler"):
            stack.start(name)
    stack.wait_started(*names)
    return names


def wait_until_held(stack: Stack, n: int, moment: dt.datetime) -> int:
    """Until all n tasks deferred and their triggers are held; the moment must not pass first.
    Returns how many triggers they wait on (1: DateTimeTrigger is shared)."""
    wait_for(
        lambda: (
            (
                stack.reached("deferred", "bench_throughput") >= n
                # One entry per trigger row: the n tasks share one DateTimeTrigger.
                and stack.pending_triggers().count >= stack.trigger_rows() > 0
            )
            or time.time() > moment.timestamp()
        ),
        timeout=3600,
        interval=0.2,
        what=f"{n} tasks to defer and their triggers to be held",
    )
    slack = moment.timestamp() - time.time()
    if slack <= 0:
        raise SystemExit("not every trigger was held by the moment: raise --lead")
    print(f"all deferred and held {slack:.1f} s before the moment", flush=True)
    return stack.trigger_rows()


if __name__ == "__main__":
    main()
