"""N tasks deferred on one DateTimeTrigger moment share one trigger: how many trigger rows,
entries and held triggers they cost, the triggerer's memory, and how fast the one event resumes
all of them.

    .venv/bin/python benchmarks/shared_triggers.py --n 10000

Starts a scheduler and a triggerer (``consume`` console scripts) on a fresh database and stream
prefix; moves N task instances to running and defers them through the worker's deferral
transition (``transitions.defer_many`` with the share key ``worker.record`` computes, in batches
as a worker's outcome batches) and publishes the trigger entries a worker would (only the one
that made the trigger row); then reads every figure from Postgres and the processes:

- trigger rows and trigger entries for the N tasks, the triggerer's ``deferral_triggers_running``
  (its held set) and RSS while they wait;
- fire -> SCHEDULED p50 / p99 / all: the moment -> each task's deferred -> scheduled change
  (``task_state_change``, Postgres's clock). No worker runs: the resumed tasks stay queued.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

from harness import Figure, Stack, median, percentile, report, resumed_by_trigger, rss_kib, wait_for
from sqlalchemy import text

from broker.streams import to_fields, trigger_message
from deferral.runtime.crypto import Cipher
from deferral.runtime.serialization import check_kwargs
from deferral.store import transitions
from deferral.triggers import DateTimeTrigger
from deferral.triggers.base import classpath_of
from worker import record
from worker.outcomes import Deferred

WORKER = "bench-worker"
BATCH = 2000  # a worker's outcome batch is at most this


def seed_running(stack: Stack, n: int) -> list[int]:
    """``n`` task instances of one running run, running on ``WORKER`` at try 1."""
    with stack.sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date)"
                " VALUES ('bench_shared', 'r1', now(), 'running', now())"
            )
        )
        return list(
            session.scalars(
                text(
                    "INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number,"
                    " worker, start_date, first_started_at)"
                    " SELECT 'bench_shared', 'r1', 't' || i, 'running', 1, :worker, now(), now()"
                    " FROM generate_series(1, :n) AS i ORDER BY i RETURNING id"
                ),
                {"n": n, "worker": WORKER},
            )
        )


def defer_all(stack: Stack, cipher: Cipher, ti_ids: list[int], moment: dt.datetime) -> int:
    """Defer every task on ``DateTimeTrigger(moment)`` as workers would; returns the number of
    trigger entries published."""
    classpath, kwargs = DateTimeTrigger(moment).serialize()
    outcome = Deferred(classpath, check_kwargs(kwargs), "resume", {}, None, shared=True)
    published = 0
    for start in range(0, len(ti_ids), BATCH):
        batch = ti_ids[start : start + BATCH]
        joined: set[int] = set()
        with stack.sessions.begin() as session:
            specs = [
                record.deferral_of(transitions.Attempt(ti, 1, WORKER), outcome, cipher)
                for ti in batch
            ]
            moved = transitions.defer_many(session, specs, joined)
        entries = [
            (
                stack.broker.keys.triggers,
                to_fields(
                    trigger_message(
                        cipher,
                        trigger_id=trigger_id,
                        classpath=classpath_of(DateTimeTrigger),
                        kwargs=outcome.trigger_kwargs,
                        task_instance_id=ti,
                        try_number=1,
                        task=f"bench_shared.r1.t{ti}",
                    )
                ),
            )
            for ti, trigger_id in moved.items()
            if ti not in joined
        ]
        if entries:
            stack.broker.publish_many(entries)
        published += len(entries)
    return published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="tasks deferred on one moment")
    parser.add_argument("--lead", type=float, default=20.0, help="seconds to the moment")
    args = parser.parse_args()
    n = args.n

    with Stack() as stack:
        stack.start("scheduler1")
        stack.start("triggerer1", "--capacity", "1000")
        stack.wait_started("scheduler1", "triggerer1")
        triggerer = stack.procs["triggerer1"].pid
        idle_rss = rss_kib(triggerer)
        cipher = Cipher(stack.env["DEFERRAL_FERNET_KEY"].split(","))
        ti_ids = seed_running(stack, n)
        moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=args.lead)
        started = time.monotonic()
        published = defer_all(stack, cipher, ti_ids, moment)
        deferring = time.monotonic() - started
        rows = stack.trigger_rows()
        wait_for(
            lambda: stack.pending_triggers().count >= rows or time.time() > moment.timestamp(),
            timeout=args.lead,
            what="the trigger to be held",
        )
        held = stack.pending_triggers().count
        waiting_rss = rss_kib(triggerer)
        if time.time() > moment.timestamp():
            raise SystemExit("the trigger was not held by the moment: raise --lead")
        wait_for(
            lambda: stack.reached("scheduled", "bench_shared") >= n,
            timeout=args.lead + 600,
            interval=0.2,
            what=f"{n} tasks resumed",
        )
        changes = stack.changes("bench_shared")

    scheduled = [(c.at - moment).total_seconds() for c in changes if resumed_by_trigger(c)]
    ok = report(
        f"shared_triggers: {n} tasks deferred on one DateTimeTrigger moment"
        " (1 scheduler, 1 triggerer, no worker)",
        [
            Figure("trigger rows", rows, "", 1),
            Figure("trigger entries published", published, "", 1),
            Figure("triggers held by the triggerer", held, "", 1),
            Figure("triggerer RSS while they wait", waiting_rss / 1024, "MiB"),
            Figure("fire -> SCHEDULED p50", median(scheduled) * 1000, "ms"),
            Figure("fire -> SCHEDULED p99", percentile(scheduled, 0.99) * 1000, "ms"),
            Figure(f"all {n} SCHEDULED after the moment", max(scheduled), "s", 2.0),
        ],
        notes=[
            f"deferring the {n} tasks took {deferring:.1f} s in this process"
            f" (batches of {BATCH}, as a worker's outcome batches)",
            f"triggerer RSS idle {idle_rss / 1024:.0f} MiB, holding the one trigger"
            f" {waiting_rss / 1024:.0f} MiB",
        ],
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
