"""Soak: runs of deferring tasks keep coming while services are killed, frozen, and Redis restarted
and wiped.

    .venv/bin/python benchmarks/soak.py --duration 150 [--seed N] [--rounds 10]

Two schedulers, two workers and two triggerers (heartbeat 1 s) on a fresh database and a Redis of
their own (``tests/redis_topologies.py``: a spare port, AOF with ``appendfsync everysec``). A run
of the soak DAG (20 tasks that defer once or twice for 1 to 8 s, then a task that needs them all)
is triggered every ``--every`` seconds for ``--duration`` seconds; meanwhile,
every ``--interval`` seconds, one fault picked at random (seeded):

- kill -9 of a random service, restarted under its name a moment later;
- SIGSTOP of a triggerer for 2 to 4 heartbeats (its triggers are taken over), then SIGCONT;
- a rolling restart of one service kind (each of its two processes in turn sent SIGTERM and,
  once it exited, started again);
- kill -9 of Redis, started again a moment later from its AOF, or without its files (every key
  lost: the reconciler republishes from PostgreSQL);

and once, halfway, every key under the prefix is deleted. The database is a private PostgreSQL
cluster's (``tests/postgres_topologies.py``), restarted at a quarter and three quarters of the
churn (an immediate shutdown, then a fast one stopped for 1 to 5 s). Then the faults stop and
every run must finish, and the benchmark checks, from Postgres and the logs:

- every task instance succeeded, and exactly once (one change to success in task_state_change);
- every deferral was resumed once (deferred -> scheduled changes = running -> deferred changes);
- nothing was dead-lettered; the reconciler logged its repairs after the wipe.

Exit status 0 if every check held (``--rounds R``: R rounds in a row, each on a fresh stack,
stopping at the first that fails; its logs are kept).
"""

from __future__ import annotations

import argparse
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness import Stack, calibration, load_average, wait_for

from tests.postgres_topologies import LocalPostgres
from tests.redis_topologies import LocalRedis

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.operators import EmptyOperator
from deferral.triggers import TimeDeltaTrigger


class Wait(BaseOperator):
    def __init__(self, *, seconds, times, **kwargs):
        super().__init__(**kwargs)
        self.seconds, self.times = seconds, times

    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.seconds)),
            method_name="resume",
            kwargs={"left": self.times - 1},
        )

    def resume(self, context, event, left):
        if left:
            self.defer(
                trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.seconds)),
                method_name="resume",
                kwargs={"left": left - 1},
            )
        return "woke"


with DAG("soak", max_active_runs=1000, max_active_tasks=64) as dag:
    # A worker killed mid-attempt fails that try into a retry.
    waits = [
        Wait(task_id=f"w{i}", seconds=1 + i % 8, times=1 + i % 2, retries=10,
             retry_delay=dt.timedelta(0))
        for i in range(20)
    ]
    waits >> EmptyOperator(task_id="join", retries=10, retry_delay=dt.timedelta(0))
"""

TASKS_PER_RUN = 21
SERVICES = {
    "scheduler1": (),
    "scheduler2": (),
    "worker1": ("--concurrency", "4"),
    "worker2": ("--concurrency", "4"),
    "triggerer1": (),
    "triggerer2": (),
}
REPAIRED = "reconciler: republished"


@dataclass
class Faults:
    kills: Counter[str] = field(default_factory=Counter)
    stops: int = 0
    wiped_keys: int = 0
    rolled: Counter[str] = field(default_factory=Counter)
    postgres_restarts: list[str] = field(default_factory=list)
    redis_restarts: Counter[str] = field(default_factory=Counter)


def restart_postgres(cluster: LocalPostgres, rng: random.Random, faults: Faults) -> str:
    """The first time an immediate shutdown (as a crash) and start; then a fast shutdown, the
    server stopped 1 to 5 s."""
    if not faults.postgres_restarts:
        cluster.stop_server(cluster.primary_port, "immediate")
        done = "restarted PostgreSQL (immediate shutdown)"
    else:
        cluster.stop_server(cluster.primary_port, "fast")
        away = rng.uniform(1, 5)
        time.sleep(away)
        done = f"stopped PostgreSQL for {away:.1f} s"
    cluster.start_server(cluster.primary_port)
    faults.postgres_restarts.append(done)
    return done


@dataclass
class Rolling:
    """A rolling restart of one service kind under way: each of its processes in turn sent
    SIGTERM, started again once it exited, the next once it is up. Advanced a step per churn
    loop, so that runs keep coming meanwhile (a worker's start takes tens of seconds on a
    loaded machine)."""

    kind: str
    left: list[str]
    phase: str = "up"  # of left[0]: up, stopping, starting

    def advance(self, stack: Stack) -> bool:
        """One step; True once every process of the kind is up again."""
        name = self.left[0]
        if self.phase == "up":
            stack.signal(name, signal.SIGTERM)
            self.phase = "stopping"
        elif self.phase == "stopping" and stack.procs[name].poll() is not None:
            stack.start(name, *SERVICES[name])
            self.phase = "starting"
        elif self.phase == "starting" and stack.started(name):
            self.left.pop(0)
            self.phase = "up"
        return not self.left


def rolling_restart(kind: str) -> Rolling:
    return Rolling(kind, sorted(n for n in SERVICES if n.rstrip("0123456789") == kind))


def restart_redis(redis: LocalRedis, rng: random.Random) -> str:
    """kill -9 of the soak's Redis, started again a moment later from its AOF or without its
    files; says which."""
    kept = rng.random() < 0.5
    redis.down()
    time.sleep(rng.uniform(0.2, 2.0))
    redis.up(data=kept)
    return "from its AOF" if kept else "without its data"


def churn(
    stack: Stack,
    cluster: LocalPostgres,
    redis: LocalRedis,
    args: argparse.Namespace,
    rng: random.Random,
) -> tuple[Faults, int]:
    """Trigger runs and inject faults for ``args.duration`` seconds; return the faults and the
    number of runs triggered."""
    faults = Faults()
    beat = args.heartbeat
    began = time.monotonic()
    next_run = next_fault = began
    runs = 0
    rolling: Rolling | None = None
    while (now := time.monotonic()) < began + args.duration:
        if now >= next_run:
            stack.trigger("soak", [f"r{runs}"])
            runs += 1
            next_run += args.every
        if not faults.wiped_keys and now > began + args.duration / 2:
            keys = list(stack.broker.redis.scan_iter(match=f"{stack.name}:*", count=1000))
            stack.broker.redis.delete(*keys)
            faults.wiped_keys = len(keys)
            print(f"  {now - began:5.1f} s: deleted all {len(keys)} keys under the prefix")
        elif (
            len(faults.postgres_restarts) < 2
            and now > began + args.duration * (1 + 2 * len(faults.postgres_restarts)) / 4
        ):
            print(f"  {now - began:5.1f} s: {restart_postgres(cluster, rng, faults)}")
        elif rolling is not None:  # no other fault meanwhile
            if rolling.advance(stack):
                faults.rolled[rolling.kind] += 1
                print(f"  {now - began:5.1f} s: the {rolling.kind}s are all up again")
                rolling, next_fault = None, now + args.interval
        elif now >= next_fault:
            next_fault += args.interval
            draw = rng.random()
            if draw < 0.1:
                rolling = rolling_restart(rng.choice(["scheduler", "worker", "triggerer"]))
                print(f"  {now - began:5.1f} s: rolling restart of the {rolling.kind}s (SIGTERM)")
            elif draw < 0.2:
                how = restart_redis(redis, rng)
                faults.redis_restarts[how] += 1
                print(f"  {now - began:5.1f} s: killed Redis (SIGKILL), started it again {how}")
            elif draw < 0.4:
                victim = rng.choice(["triggerer1", "triggerer2"])
                stack.signal(victim, signal.SIGSTOP)
                time.sleep(rng.uniform(2 * beat, 4 * beat))
                stack.signal(victim, signal.SIGCONT)
                faults.stops += 1
                print(f"  {now - began:5.1f} s: stopped {victim} (SIGSTOP), then SIGCONT")
            else:
                victim = rng.choice(sorted(SERVICES))
                stack.signal(victim, signal.SIGKILL)
                time.sleep(rng.uniform(0.2, 1.5))
                stack.start(victim, *SERVICES[victim])
                faults.kills[victim] += 1
                print(f"  {now - began:5.1f} s: killed {victim} (SIGKILL), started it again")
        time.sleep(0.05)
    if rolling is not None:  # finished: no process is left stopped for the drain
        wait_for(lambda: rolling.advance(stack), timeout=300, what="the rolling restart's end")
        faults.rolled[rolling.kind] += 1
    return faults, runs


def check(stack: Stack, runs: int) -> list[str]:
    """What went wrong, from Postgres and the logs; empty if nothing did."""
    problems = []
    expected = runs * TASKS_PER_RUN
    states = stack.states()
    if states != {"success": expected}:
        problems.append(f"task states {states}, expected {expected} successes")
    changes = stack.changes("soak")
    successes = Counter(c.task_instance_id for c in changes if c.to_state == "success")
    twice = {ti: n for ti, n in successes.items() if n > 1}
    if twice:
        problems.append(f"task instances that succeeded more than once: {twice}")
    deferred = Counter(c.task_instance_id for c in changes if c.to_state == "deferred")
    resumed = Counter(
        c.task_instance_id
        for c in changes
        if c.from_state == "deferred" and c.to_state == "scheduled"
    )
    if deferred != resumed:
        odd = {ti: (deferred[ti], resumed[ti]) for ti in deferred | resumed}
        odd = {ti: pair for ti, pair in odd.items() if pair[0] != pair[1]}
        problems.append(f"deferrals and resumes differ (ti: deferred, resumed): {odd}")
    dead = stack.broker.redis.xlen(stack.broker.keys.dead)
    if dead:
        problems.append(f"{dead} dead-lettered entr(ies)")
    scheduler_logs = stack.log("scheduler1") + stack.log("scheduler2")
    if REPAIRED not in scheduler_logs:
        problems.append(f"no repair logged by the reconciler ({REPAIRED!r})")
    return problems


def soak_round(args: argparse.Namespace, seed: int) -> bool:
    rng = random.Random(seed)
    cluster = LocalPostgres()
    passed = False
    try:
        # PostgreSQL listening first: its ports are only picked free, and Redis picks its own.
        cluster.start()
        with tempfile.TemporaryDirectory(prefix="soak-redis-") as home:
            redis = LocalRedis(Path(home)).start()
            try:
                passed = _soak_round_on(cluster, redis, args, seed, rng)
            finally:
                redis.stop()
    finally:
        if passed or not cluster.answers(cluster.primary_port):
            cluster.stop()
        else:  # a failed round is looked into with its database
            print(f"kept: PostgreSQL at {cluster.admin_url()}, data in {cluster.home}")
    return passed


def _soak_round_on(
    cluster: LocalPostgres,
    redis: LocalRedis,
    args: argparse.Namespace,
    seed: int,
    rng: random.Random,
) -> bool:
    with Stack(
        heartbeat_sec=args.heartbeat,
        keep=True,
        admin_url=cluster.admin_url(),
        redis_url=redis.url,
    ) as stack:
        stack.write_dag("soak", DAG)
        for name, options in SERVICES.items():
            stack.start(name, *options)
        stack.wait_started(*SERVICES)
        print(f"round seed {seed}: {load_average()}", flush=True)
        faults, runs = churn(stack, cluster, redis, args, rng)
        drained = time.monotonic()
        wait_for(
            lambda: stack.finished_runs("soak") >= runs,
            timeout=args.drain,
            interval=0.5,
            what=f"all {runs} runs to finish",
        )
        drain = time.monotonic() - drained
        problems = check(stack, runs)
        repairs = sum(stack.log(name).count(REPAIRED) for name in ("scheduler1", "scheduler2"))
        changes = stack.changes("soak")
        retries = sum(1 for c in changes if c.to_state == "up_for_retry")
        print(
            f"round seed {seed}: {runs} runs, {runs * TASKS_PER_RUN} tasks in {args.duration:g} s"
            f" of churn; {sum(faults.kills.values())} kills {dict(faults.kills)}, {faults.stops}"
            f" SIGSTOPs, Redis restarts {dict(faults.redis_restarts)}, {faults.wiped_keys} keys"
            f" wiped; rolling restarts {dict(faults.rolled)};"
            f" PostgreSQL: {', '.join(faults.postgres_restarts)}; {retries} tries failed by kills,"
            f" {repairs} reconciler repair line(s); drained in {drain:.1f} s; {load_average()}"
        )
        for problem in problems:
            print(f"  FAILED: {problem}")
        stack.keep = bool(problems)
        return not problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of churn")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between new runs")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between faults")
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--drain", type=float, default=600.0, help="seconds allowed to finish")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(calibration(), flush=True)
    for round_ in range(args.rounds):
        if not soak_round(args, args.seed + round_):
            raise SystemExit(f"soak failed in round {round_ + 1} (seed {args.seed + round_})")
    print(f"soak passed {args.rounds} round(s) in a row")


if __name__ == "__main__":
    main()
