"""A rolling restart of every service during N deferrals: nothing lost or doubled, no try counted,
and the stopped triggerer's triggers running again on its peer within a second of its exit.

    .venv/bin/python benchmarks/rolling_restart.py --n 1000

Two schedulers, two workers and two triggerers (heartbeat ``--heartbeat`` seconds, 1 by default)
on a fresh database and stream prefix. N runs of one task (``retries=0``: a try counted against
it would fail it) each defer on a ``TimeDeltaTrigger`` of 10 to 40 s and, resumed, work
``--work`` seconds. Once the first has resumed, while the others wait and resume, each process
in turn (scheduler1, triggerer1, worker1, scheduler2, triggerer2, worker2) is sent SIGTERM and,
once it exited, started again under its name; the next waits until it consumes. Workers stop
with ``DEFERRAL_WORKER_STOP_GRACE_SEC`` = ``--grace`` (shorter than the work, so some attempts
are handed back). For a triggerer, the benchmark waits until every trigger entry it held is held
by its peer (Redis: the group's pending lists) or retired, and every trigger it ran is recorded
as run by its peer (Postgres: ``trigger.triggerer_id``) or has fired; then reads from the
tries' logs when the last of those triggers started there ("trigger N ... started on triggerer
P", stamped to the microsecond): that, less the moment the stopped process exited, is the figure
(the polls themselves lag on a loaded machine).

Counted from ``task_state_change`` once every run finished: each task succeeded exactly once
and was resumed by its trigger exactly once; none failed, went up for retry, or ended at a try
other than 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import signal
import time
from collections import Counter

from harness import Figure, Stack, report, resumed_by_trigger, wait_for
from redis.exceptions import ResponseError
from sqlalchemy import func, select

from broker.streams import GROUP_TRIGGERERS
from deferral.store.tables import TaskInstance, TaskLog, Trigger
from deferral.store.tasklogs import SOURCE_TRIGGERER

DAG_ID = "bench_rolling"
DAG = """
import datetime as dt
import time

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class WaitThenWork(BaseOperator):
    def execute(self, context):
        seconds = 10 + int(context["run_id"][1:]) % 31
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=seconds)), method_name="work")

    def work(self, context, event):
        time.sleep({work})
        return "done"


with DAG("bench_rolling", schedule=None, max_active_runs=100000) as dag:
    WaitThenWork(task_id="t", retries=0)
"""

# One of each kind, then the other: the restarts fall while tasks resume.
ORDER = ["scheduler1", "triggerer1", "worker1", "scheduler2", "triggerer2", "worker2"]


def run_by(stack: Stack, ids: list[int]) -> dict[int, str | None]:
    """Who runs each of these triggers now (a trigger row gone: it fired, absent here)."""
    with stack.sessions() as session:
        rows = session.execute(select(Trigger.id, Trigger.triggerer_id).where(Trigger.id.in_(ids)))
        return {row.id: row.triggerer_id for row in rows}


def entries_held(stack: Stack) -> dict[tuple[str, str], str]:
    """Every pending trigger entry (stream, id) with the triggerer holding it."""
    held: dict[tuple[str, str], str] = {}
    for stream in stack.broker.keys.triggers_of("default"):
        try:
            reply = stack.broker.redis.execute_command(
                "XPENDING", stream, GROUP_TRIGGERERS, "-", "+", 1_000_000
            )
        except ResponseError:
            continue  # no stream or group yet
        held.update({(stream, i.decode()): owner.decode() for i, owner, _, _ in reply})
    return held


STARTED = re.compile(r"trigger (\d+) \(.*\) for \S+ started on triggerer (\S+)$")


def last_started(stack: Stack, peer: str, ids: list[int], since: float) -> float:
    """The Unix time at which the last of the triggers ``ids`` that ``peer`` started after
    ``since`` started there, by their tries' logs (a timer moved with others is named there
    only); ``since`` if it started none: they had fired."""
    wanted, last = set(ids), since
    with stack.sessions() as session:
        lines = session.execute(
            select(TaskLog.at, TaskLog.text).where(
                TaskLog.source == SOURCE_TRIGGERER,
                TaskLog.at >= dt.datetime.fromtimestamp(since, dt.UTC),
                TaskLog.text.like(f"%started on triggerer {peer}"),
            )
        ).all()
    for at, line in lines:
        found = STARTED.search(line)
        if found and found.group(2) == peer and int(found.group(1)) in wanted:
            last = max(last, at.timestamp())
    return last


def ran_by(stack: Stack, name: str) -> list[int]:
    with stack.sessions() as session:
        return list(session.scalars(select(Trigger.id).where(Trigger.triggerer_id == name)))


def restart(stack: Stack, name: str, args: argparse.Namespace) -> None:
    stack.start(name, *args.service_args.get(name.rstrip("0123456789"), ()))
    stack.wait_started(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="deferring runs")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="DEFERRAL_HEARTBEAT_SEC")
    parser.add_argument("--grace", type=float, default=0.2, help="workers' stop grace, seconds")
    parser.add_argument("--work", type=float, default=1.0, help="seconds a resumed task works")
    parser.add_argument("--concurrency", type=int, default=16, help="slots per worker")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between restarts")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    args.service_args = {"worker": ("--concurrency", str(args.concurrency))}

    stopped_in: dict[str, float] = {}
    running_again: list[float] = []
    recorded_again: list[float] = []
    handed: list[int] = []
    env = {"DEFERRAL_WORKER_STOP_GRACE_SEC": f"{args.grace:g}"}
    with Stack(heartbeat_sec=args.heartbeat, keep=args.keep_logs, extra_env=env) as stack:
        stack.write_dag("bench_rolling", DAG.format(work=args.work))
        for name in ORDER:
            restart(stack, name, args)
        started = time.monotonic()
        stack.trigger(DAG_ID, [f"r{i:05d}" for i in range(args.n)])
        wait_for(
            lambda: stack.reached("success", DAG_ID) >= 1,
            timeout=600,
            what="the first task to resume and succeed",
        )
        for name in ORDER:
            time.sleep(args.pause)
            kind = name.rstrip("0123456789")
            held = ran_by(stack, name) if kind == "triggerer" else []
            entries = [e for e, owner in entries_held(stack).items() if owner == name]
            signalled = time.monotonic()
            stack.signal(name, signal.SIGTERM)
            stack.procs[name].wait(timeout=600)
            exited = time.monotonic()
            exited_at = time.time()
            stopped_in[name] = exited - signalled
            if kind == "triggerer":
                peer = next(n for n in ORDER if n.startswith("triggerer") and n != name)
                wait_for(
                    lambda entries=entries, peer=peer: all(  # type: ignore[misc]
                        entries_held(stack).get(e, peer) == peer for e in entries
                    ),
                    timeout=60,
                    interval=0.01,
                    what=f"{peer} to hold {name}'s {len(entries)} trigger entries",
                )
                wait_for(
                    lambda held=held, peer=peer: all(  # type: ignore[misc]
                        owner == peer for owner in run_by(stack, held).values()
                    ),
                    timeout=60,
                    interval=0.01,
                    what=f"{peer} to be recorded running {name}'s {len(held)} triggers",
                )
                recorded_again.append(time.monotonic() - exited)
                since = exited_at - 5.0  # the hand-off comes before the exit
                running_again.append(last_started(stack, peer, held, since) - exited_at)
                handed.append(len(entries))
            print(
                f"{name}: stopped {stopped_in[name]:.2f} s after SIGTERM"
                + (
                    f"; its {handed[-1]} trigger entries' triggers all started on its peer"
                    f" {running_again[-1]:.2f} s after its exit (by the tries' logs; seen"
                    f" recorded {recorded_again[-1]:.2f} s after it)"
                    if kind == "triggerer"
                    else ""
                ),
                flush=True,
            )
            restart(stack, name, args)
        wait_for(
            lambda: stack.finished_runs(DAG_ID) >= args.n,
            timeout=900,
            interval=0.2,
            what=f"{args.n} runs to finish",
        )
        elapsed = time.monotonic() - started
        changes = stack.changes(DAG_ID)
        with stack.sessions() as session:
            of_dag = TaskInstance.dag_id == DAG_ID
            tries = Counter(session.scalars(select(TaskInstance.try_number).where(of_dag)))
            succeeded = session.scalar(
                select(func.count()).where(of_dag, TaskInstance.state == "success")
            )

    success = Counter(c.task_instance_id for c in changes if c.to_state == "success")
    resumed = Counter(c.task_instance_id for c in changes if resumed_by_trigger(c))
    retried = [c for c in changes if c.to_state in ("up_for_retry", "failed")]
    handed_back = [c for c in changes if "handed it back" in (c.reason or "")]
    doubled = sum(1 for n in success.values() if n > 1) + sum(1 for n in resumed.values() if n > 1)
    ok = report(
        f"rolling_restart: every service restarted one at a time (SIGTERM, then started again)"
        f" during {args.n} deferrals; heartbeat {args.heartbeat:g} s, workers' stop grace"
        f" {args.grace:g} s, resumed tasks work {args.work:g} s",
        [
            Figure("tasks lost (not succeeded)", args.n - int(succeeded or 0), "", 0),
            Figure("tasks succeeded or resumed more than once", doubled, "", 0),
            Figure(
                "tries counted (failed, up for retry, or try > 1)",
                len(retried) + sum(n for t, n in tries.items() if t != 1),
                "",
                0,
            ),
            Figure("attempts handed back by a stopping worker", len(handed_back), ""),
            Figure(
                "stopped triggerer's triggers all started on its peer after its exit, worst",
                max(running_again),
                "s",
                1.0,
            ),
            Figure("all runs finished after the first was triggered", elapsed, "s"),
        ],
        [
            "SIGTERM -> exit: "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in stopped_in.items()),
            "triggers handed off (all started on the peer, by the tries' logs / seen recorded): "
            + ", ".join(
                f"{n} in {s:.2f} / {r:.2f} s"
                for n, s, r in zip(handed, running_again, recorded_again, strict=True)
            ),
        ],
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
