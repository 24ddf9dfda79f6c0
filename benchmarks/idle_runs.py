"""One task's fire -> SCHEDULED and fire -> SUCCESS, alone and while 10,000 other runs wait.

    .venv/bin/python benchmarks/idle_runs.py --idle 10000

Starts a scheduler, workers and a triggerer (``consume`` console scripts) on a fresh database and
stream prefix. A probe DAG has one task that defers on a ``DateTimeTrigger`` a second ahead and
returns the moment it woke for. The probe runs ``--samples`` times one after the other, first
with nothing else in the system, then again once ``--idle`` runs of another DAG sit with their
task deferred (on triggers a day ahead), and the benchmark reports for each phase the median,
from the trigger's moment, of the task's deferred -> scheduled change and of its success (from
``task_state_change``, Postgres's clock), and splits fire -> SCHEDULED at the moment the event
could be read from the stream (the triggerer's side, then the scheduler's). A loop's cost must
not grow with runs that only wait.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

from harness import (
    Change,
    EventsWatch,
    Figure,
    Profiles,
    Stack,
    add_service_arguments,
    median,
    percentile,
    report,
    resumed_by_trigger,
    wait_for,
)
from sqlalchemy import text

# A task that defers {delay} seconds and returns the moment it woke for (chain_latency too).
PROBE_OPERATOR = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger


class Probe(BaseOperator):
    def execute(self, context):
        moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds={delay})
        self.defer(trigger=DateTimeTrigger(moment), method_name="resume")

    def resume(self, context, event):
        return event.isoformat()
"""

PROBE_DAG = (
    PROBE_OPERATOR
    + """

with DAG("bench_probe", max_active_runs=1) as dag:
    Probe(task_id="probe")
"""
)

IDLE_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger


class WaitADay(BaseOperator):
    def execute(self, context):
        moment = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
        self.defer(trigger=DateTimeTrigger(moment), method_name="resume")

    def resume(self, context, event):
        return None


with DAG("bench_idle", max_active_runs={idle}) as dag:
    WaitADay(task_id="wait")
"""


def run_one_after_another(stack: Stack, dag_id: str, run_ids: list[str]) -> None:
    """Trigger each run of ``dag_id`` once the one before has succeeded."""
    for run_id in run_ids:
        stack.trigger(dag_id, [run_id])
        wait_for(
            lambda run_id=run_id: stack.run_state(dag_id, run_id) == "success",  # type: ignore[misc]
            timeout=120,
            interval=0.05,
            what=f"run {run_id} of {dag_id}",
        )


def probe(stack: Stack, runs: int, label: str) -> tuple[list[float], list[float]]:
    """Run the probe DAG ``runs`` times, one after the other; fire -> scheduled and fire ->
    success of each, in ms."""
    with EventsWatch(stack) as watch:
        run_one_after_another(stack, "bench_probe", [f"{label}{i}" for i in range(runs)])
    with stack.sessions() as session:
        rows = session.execute(
            text(
                "SELECT ti.id, x.value #>> '{}', r.trigger_id FROM xcom x"
                " JOIN task_instance ti ON ti.id = x.task_instance_id"
                " JOIN resume_event r ON r.task_instance_id = ti.id"
                " WHERE ti.dag_id = 'bench_probe' AND ti.run_id LIKE :label"
            ),
            {"label": f"{label}%"},
        ).all()
    moments = {ti_id: dt.datetime.fromisoformat(value) for ti_id, value, _ in rows}
    readable = {ti_id: watch.seen[t] for ti_id, _, t in rows if t in watch.seen}
    changes = [c for c in stack.changes("bench_probe") if c.task_instance_id in moments]
    print(f"{label}: {split(changes, moments, readable)}", flush=True)
    scheduled = [
        (c.at - moments[c.task_instance_id]).total_seconds() * 1000
        for c in changes
        if resumed_by_trigger(c)
    ]
    succeeded = [
        (c.at - moments[c.task_instance_id]).total_seconds() * 1000
        for c in changes
        if c.to_state == "success"
    ]
    print(f"{label}: after the fire, median ms per step: {steps(changes, moments)}", flush=True)
    return scheduled, succeeded


def split(
    changes: list[Change], moments: dict[int, dt.datetime], readable: dict[int, dt.datetime]
) -> str:
    """fire -> SCHEDULED in two: the triggerer's side (moment -> its event readable in the
    stream) and the scheduler's (readable -> the state change), medians and p99s, in ms."""
    triggerer, scheduler = [], []
    for change in changes:
        ti = change.task_instance_id
        if resumed_by_trigger(change) and ti in readable:
            triggerer.append((readable[ti] - moments[ti]).total_seconds() * 1000)
            scheduler.append((change.at - readable[ti]).total_seconds() * 1000)
    if not triggerer:
        return "no event seen in the stream"
    return (
        f"moment -> event readable p50 {median(triggerer):.2f} ms (p99"
        f" {percentile(triggerer, 0.99):.2f}), readable -> SCHEDULED p50 {median(scheduler):.2f}"
        f" ms (p99 {percentile(scheduler, 0.99):.2f}; {len(triggerer)} probes)"
    )


def steps(changes: list[Change], moments: dict[int, dt.datetime]) -> str:
    """The median time of each state change after the resume, from the one before it (from the
    moment for the resume itself), to show where fire -> SUCCESS goes."""
    last: dict[int, dt.datetime] = {}
    taken: dict[str, list[float]] = {}
    for change in changes:
        ti = change.task_instance_id
        if resumed_by_trigger(change):
            last[ti] = moments[ti]
        if ti not in last:
            continue
        step = f"{change.from_state}->{change.to_state}"
        taken.setdefault(step, []).append((change.at - last[ti]).total_seconds() * 1000)
        last[ti] = change.at
    return ", ".join(f"{step} {median(values):.1f}" for step, values in taken.items())


def start_probe_services(stack: Stack, workers: int, concurrency: int, capacity: int) -> list[str]:
    """A scheduler, a triggerer holding up to ``capacity`` triggers and ``workers`` workers of
    ``concurrency`` slots, started; returns their names."""
    names = ["scheduler1", "triggerer1"] + [f"worker{i + 1}" for i in range(workers)]
    stack.start("scheduler1")
    stack.start("triggerer1", "--capacity", str(capacity))
    for name in names[2:]:
        stack.start(name, "--concurrency", str(concurrency))
    stack.wait_started(*names)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=10_000, help="runs waiting meanwhile")
    parser.add_argument("--samples", type=int, default=30, help="probe runs per phase")
    parser.add_argument("--delay", type=float, default=1.0, help="seconds each probe defers")
    add_service_arguments(parser, concurrency=8)
    parser.add_argument("--profile", action="store_true", help="py-spy the probes with idle runs")
    args = parser.parse_args()

    with Stack(keep=args.keep_logs) as stack:
        stack.write_dag("bench_probe", PROBE_DAG.format(delay=args.delay))
        stack.write_dag("bench_idle", IDLE_DAG.format(idle=args.idle))
        names = start_probe_services(stack, args.workers, args.concurrency, args.idle + 100)
        stack.warm_up("bench_probe")  # first imports and connections

        alone = probe(stack, args.samples, "alone")
        print(f"alone: fire -> SUCCESS p50 {median(alone[1]):.1f} ms", flush=True)

        started = time.monotonic()
        stack.trigger("bench_idle", [f"idle{i}" for i in range(args.idle)])
        # Tasks whose moments are equal to the microsecond share one trigger (issue 18): the
        # triggerer holds one entry per trigger row, not per task; and none for a far timer
        # (a day ahead, beyond the horizon: it waits as a row, issue 30).
        wait_for(
            lambda: (
                stack.states().get("deferred", 0) >= args.idle
                and stack.pending_triggers().count >= stack.published_trigger_rows()
            ),
            timeout=3600,
            interval=1.0,
            what=f"{args.idle} idle runs to defer",
        )
        print(f"{args.idle} idle runs deferred in {time.monotonic() - started:.0f} s", flush=True)
        # Runs that have been waiting a while have been vacuumed and analyzed: measure that
        # state, not autovacuum's pass over the rows just loaded (it otherwise lands, or not, in
        # the middle of the probes: fire -> SUCCESS p50 9 to 24 ms from one run to the next).
        stack.vacuum_analyze()
        with Profiles(stack, names if args.profile else []) as profiles:
            crowded = probe(stack, args.samples, "crowded")
        if args.profile:  # before the stack's folder (the raw profiles in it) is removed
            print(profiles.summary())

    figures = []
    for phase, (scheduled, succeeded) in (
        ("alone", alone),
        (f"with {args.idle} idle runs", crowded),
    ):
        figures += [
            Figure(f"{phase}: fire -> SCHEDULED p50", median(scheduled), "ms", 5),
            Figure(f"{phase}: fire -> SCHEDULED p99", percentile(scheduled, 0.99), "ms"),
            Figure(f"{phase}: fire -> SUCCESS p50", median(succeeded), "ms", 10),  # issue 13
            Figure(f"{phase}: fire -> SUCCESS p99", percentile(succeeded, 0.99), "ms"),
        ]
    ok = report(
        f"idle_runs: one task deferring {args.delay:g} s, {args.samples} samples per phase",
        figures,
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
