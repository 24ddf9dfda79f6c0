"""Redis goes away and comes back under 500 deferring tasks, case by case (issue 34, Build 3).

    .venv/bin/python benchmarks/redis_faults.py [--n 500] [--outage 30] [--cases aof,lost,...]

Two schedulers, two workers (4 slots each) and two triggerers (heartbeat 1 s) on a fresh
database and a Redis of their own on a spare port (``tests/redis_topologies.py``: AOF with
``appendfsync everysec`` and ``noeviction``; for ``sentinel`` a primary, a replica and three
sentinels, the services on ``redis+sentinel://``). In each case a run of N tasks is triggered,
each deferring once on a timer of 1 to 20 s and, resumed, appending a line to a file of its own;
once a quarter of them succeeded, the fault:

- ``aof``: kill -9 of Redis, started again at once from its AOF;
- ``lost``: kill -9, started again without its files (every key lost: the reconciler rebuilds);
- ``stopped``: Redis stopped (SIGTERM) for ``--outage`` seconds, then started again;
- ``full``: ``maxmemory`` below what Redis uses (``noeviction``: every write refused) for
  ``--outage`` seconds, then freed;
- ``sentinel``: kill -9 of the primary; the sentinels promote the replica.

Per case: whether every task succeeded exactly once (one change to success in
task_state_change, one line in its side-effect file), whether every service is still running,
and the seconds from the server's return (the promotion, for ``sentinel``) to the first task
that succeeded after it (target: within 10 s).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import Figure, Stack, load_average, report, wait_for
from soak import SERVICES

from tests.redis_topologies import LocalRedis, LocalSentinel

DAG = """
import datetime as dt
import os

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger

OUT = {out!r}


class Wait(BaseOperator):
    def __init__(self, *, seconds, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.seconds)), method_name="resume"
        )

    def resume(self, context, event):
        with open(os.path.join(OUT, self.task_id), "a") as out:
            out.write("ran\\n")


with DAG({dag_id!r}, max_active_tasks={n}) as dag:
    for i in range({n}):
        Wait(task_id=f"t{{i}}", seconds=1 + i % 20)
"""

RESUME_TARGET_SEC = 10.0
CASES = ("aof", "lost", "stopped", "full", "sentinel")


@contextmanager
def services_on(redis_url: str, cases: list[str], n: int, keep: bool) -> Iterator[Stack]:
    with Stack(
        heartbeat_sec=1.0, redis_url=redis_url, prefix="deferral_rfault", keep=keep
    ) as stack:
        # Every case's DAG is in the folder before the schedulers start: a run whose DAG a
        # scheduler has not read yet may lose its evaluation mark there (see the README's row).
        for case in cases:
            out = stack.home / f"rfault_{case}"
            out.mkdir()
            stack.write_dag(out.name, DAG.format(dag_id=out.name, out=str(out), n=n))
        for name, options in SERVICES.items():
            stack.start(name, *options)
        stack.wait_started(*SERVICES)
        yield stack


def fault_of(case: str, redis: LocalRedis, outage: float) -> Callable[[], None]:
    """What ``case`` does to ``redis``; returns once it is back."""

    def aof() -> None:
        redis.down()
        redis.up()

    def lost() -> None:
        redis.down()
        redis.up(data=False)

    def stopped() -> None:
        redis.down(signal.SIGTERM)
        time.sleep(outage)  # the outage itself
        redis.up()

    def full() -> None:
        redis.full()
        time.sleep(outage)  # the outage itself
        redis.full(refuse=False)

    return {"aof": aof, "lost": lost, "stopped": stopped, "full": full}[case]


def run_case(stack: Stack, case: str, n: int, fault: Callable[[], None]) -> list[Figure]:
    dag_id = f"rfault_{case}"
    out = stack.home / dag_id
    stack.trigger(dag_id, ["r1"])
    began = time.monotonic()
    wait_for(lambda: stack.reached("success", dag_id) >= n // 4, timeout=900, what="a quarter")
    at_fault = stack.reached("success", dag_id)
    fault()
    returned = dt.datetime.now(dt.UTC)
    wait_for(lambda: stack.finished_runs(dag_id) >= 1, timeout=600, interval=0.5, what="the run")
    took = time.monotonic() - began

    changes = stack.changes(dag_id)
    successes = Counter(c.task_instance_id for c in changes if c.to_state == "success")
    after = [c.at for c in changes if c.to_state == "success" and c.at >= returned]
    lines = Counter(p.read_text().count("ran") for p in out.iterdir())
    dead = [name for name, proc in stack.procs.items() if proc.poll() is not None]
    exactly_once = (
        len(successes) == n and set(successes.values()) == {1} and lines == Counter({1: n})
    )
    print(
        f"  {case}: {at_fault} of {n} had succeeded at the fault; run finished {took:.1f} s after"
        f" the trigger; successes per task {dict(Counter(successes.values()))}, side-effect lines"
        f" per task {dict(lines)}, {stack.broker.redis.xlen(stack.broker.keys.dead)} dead"
        f" letter(s); services dead: {dead or 'none'}; {load_average()}",
        flush=True,
    )
    figures = [
        Figure(f"{case}: tasks not exactly once", 0 if exactly_once else n, "tasks", 0),
        Figure(f"{case}: services dead", len(dead), "services", 0),
        Figure(
            f"{case}: return -> first success after it",
            (min(after) - returned).total_seconds() if after else float("inf"),
            "s",
            RESUME_TARGET_SEC,
        ),
    ]
    for figure in figures:  # now: a later case that hangs must not take these with it
        print(figure.line(), flush=True)
    return figures


def sentinel_case(home: Path, n: int, keep: bool) -> list[Figure]:
    (home / "sentinel").mkdir()
    topology = LocalSentinel(home / "sentinel").start()
    try:
        with services_on(topology.url, ["sentinel"], n, keep) as stack:

            def failover() -> None:
                topology.kill_primary()  # returns once the replica is promoted

            return run_case(stack, "sentinel", n, failover)
    finally:
        topology.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=500, help="tasks per case")
    parser.add_argument("--outage", type=float, default=30.0, help="seconds stopped or full")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--keep-logs", action="store_true", help="keep the database and logs")
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"--cases: no such case {sorted(unknown)[0]!r} (one of {', '.join(CASES)})")
    home = Path(tempfile.mkdtemp(prefix="redis_faults-"))
    figures: list[Figure] = []
    redis = LocalRedis(home / "redis").start()
    try:
        alone = [case for case in cases if case != "sentinel"]
        if alone:
            with services_on(redis.url, alone, args.n, args.keep_logs) as stack:
                for case in alone:
                    figures += run_case(stack, case, args.n, fault_of(case, redis, args.outage))
        if "sentinel" in cases:
            figures += sentinel_case(home, args.n, args.keep_logs)
    finally:
        redis.stop()
        shutil.rmtree(home, ignore_errors=True)  # the servers' files
    ok = report(
        f"Redis goes away and comes back under {args.n} deferring tasks per case"
        f" (outages of {args.outage:g} s)",
        figures,
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
