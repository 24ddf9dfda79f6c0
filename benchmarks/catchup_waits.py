"""A minutely DAG caught up: N runs, each task deferring 30 days ahead on a moment of its own.

    .venv/bin/python benchmarks/catchup_waits.py --runs 20000

Starts a scheduler, workers and a triggerer (``consume`` console scripts) on a fresh database and
stream prefix, then a probe (the one of ``idle_runs.py``: one task deferring a second) alone.
Then a DAG scheduled every minute, ``catchup=True`` from ``--runs`` minutes ago, appears in the
DAGs folder: the scheduler creates its runs, starts them in batches, and every task defers on
``logical_date + 30 days`` (a trigger each). The benchmark reports the rate at which the runs got
their task deferred, overall and per quarter (from the DAG's appearance), and the probe's
fire -> SCHEDULED and fire -> SUCCESS once they all wait. Issue 30: all deferred at >= 200
runs/s, the last quarter at >= 0.7 x the first's, fire -> SCHEDULED p50 <= 5 ms and fire ->
SUCCESS p50 within 20 % of the probe alone.
"""

from __future__ import annotations

import argparse
import itertools
import time

from harness import Figure, Stack, calibration, median, report
from idle_runs import PROBE_DAG, probe, start_probe_services
from sqlalchemy import text

CATCHUP_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger


class WaitAMonth(BaseOperator):
    def execute(self, context):
        moment = context["logical_date"] + dt.timedelta(days=30)
        self.defer(trigger=DateTimeTrigger(moment), method_name="resume")

    def resume(self, context, event):
        return None


with DAG(
    "bench_catchup",
    schedule="* * * * *",
    start_date=dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    - dt.timedelta(minutes={runs}),
    catchup=True,
    max_active_runs={runs} + 1000,
) as dag:
    WaitAMonth(task_id="wait")
"""


def deferred(stack: Stack) -> int:
    """Task instances of the catch-up DAG deferred now."""
    with stack.sessions() as session:
        return int(
            session.scalar(
                text(
                    "SELECT count(*) FROM task_instance"
                    " WHERE dag_id = 'bench_catchup' AND state = 'deferred'"
                )
            )
            or 0
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20_000, help="minutes caught up")
    parser.add_argument("--samples", type=int, default=20, help="probe runs per phase")
    parser.add_argument("--keep-logs", action="store_true")
    for option, default in (("--workers", 2), ("--concurrency", 8)):
        parser.add_argument(option, type=int, default=default)
    args = parser.parse_args()

    with Stack(keep=args.keep_logs) as stack:
        print(calibration(), flush=True)
        stack.write_dag("bench_probe", PROBE_DAG.format(delay=1.0))
        start_probe_services(stack, args.workers, args.concurrency, args.runs + 1000)
        stack.warm_up("bench_probe")  # first imports and connections
        alone = probe(stack, args.samples, "alone")

        started = time.monotonic()
        stack.write_dag("bench_catchup", CATCHUP_DAG.format(runs=args.runs))
        quarters = [args.runs * q // 4 for q in (1, 2, 3, 4)]
        reached: list[float] = []
        while len(reached) < len(quarters):
            count = deferred(stack)
            elapsed = time.monotonic() - started
            while len(reached) < len(quarters) and count >= quarters[len(reached)]:
                reached.append(elapsed)
                print(f"{count} deferred after {elapsed:.1f} s", flush=True)
            if elapsed > 3600:
                raise SystemExit(f"only {count} of {args.runs} deferred after an hour")
            time.sleep(0.5)
        # 30 days ahead, every trigger is a far timer (scheduler/DECISIONS.md 27): committed
        # with its task's deferral, it waits as a row and no triggerer holds it.
        far = stack.trigger_rows() - stack.published_trigger_rows()
        print(f"{far} far timers waiting as rows", flush=True)
        stack.vacuum_analyze()
        crowded = probe(stack, args.samples, "crowded")

    spans = [reached[0]] + [b - a for a, b in itertools.pairwise(reached)]
    rates = [args.runs / 4 / span for span in spans]
    print("per quarter, runs deferred per second: " + ", ".join(f"{r:.0f}" for r in rates))
    figures = [
        Figure(
            f"{args.runs} runs deferred, overall", args.runs / reached[-1], "runs/s", 200, False
        ),
        Figure("last quarter / first quarter", rates[-1] / rates[0], "x", 0.7, False),
        Figure("alone: fire -> SCHEDULED p50", median(alone[0]), "ms"),
        Figure("alone: fire -> SUCCESS p50", median(alone[1]), "ms"),
        Figure(f"with {args.runs} waiting: fire -> SCHEDULED p50", median(crowded[0]), "ms", 5),
        Figure(
            f"with {args.runs} waiting: fire -> SUCCESS p50",
            median(crowded[1]),
            "ms",
            1.2 * median(alone[1]),
        ),
    ]
    ok = report(f"catchup_waits: a minutely DAG, {args.runs} runs caught up", figures)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
