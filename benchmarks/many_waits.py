"""N tasks waiting at once, through the public path: what a wait costs, and whether the system
still answers while they wait (issue 30).

    .venv/bin/python benchmarks/many_waits.py --n 10000
    .venv/bin/python benchmarks/many_waits.py --n 1000000      # most of an hour

Starts a scheduler, workers and a triggerer (``consume`` console scripts) on a fresh database and
stream prefix, writes a DAG whose schedule is caught up: the scheduler creates N / --per-run runs
of it (``--via-api``: created as the API does instead), each one task mapped over --per-run map
indexes. Every task executes on a worker and defers on a ``DateTimeTrigger`` of its own moment:
a day ahead for most (far timers: they wait as rows), and for one in --fire-every a moment
spread over --fire-spread seconds starting --fire-after seconds after the benchmark started
(far too when they defer, they come within the horizon while the others wait). It prints:

- the time until all N deferred, and deferrals per second in each tenth of N (from
  ``task_state_change``, Postgres's clock);
- what each deferral wrote (rows per table, commits, WAL bytes: server-wide) and the CPU each
  process used deferring, then idle while the N wait;
- per wait: PostgreSQL bytes (tables with their indexes; the whole database), Redis bytes (the
  prefix's keys), triggerer RSS (nothing is held for a far timer), and the triggerer's RSS per
  held time trigger once the fired share is held;
- a probe task's fire -> SCHEDULED and fire -> SUCCESS (idle_runs' probe, one after another),
  alone and while the N wait;
- the fired share: each resumed exactly once (and no other task resumed), fire -> SCHEDULED.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

from harness import (
    CpuMeter,
    Figure,
    RowMeter,
    Stack,
    add_service_arguments,
    calibration,
    load_average,
    median,
    percentile,
    postgres_bytes,
    redis_bytes,
    report,
    rss_kib,
    wait_for,
)
from idle_runs import PROBE_DAG, probe
from sqlalchemy import text

DAG_ID = "bench_waits"

WAITS_DAG = """
import datetime as dt
from pathlib import Path

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger

FIRE_AT = dt.datetime.fromisoformat({fire_at!r})


class Wait(BaseOperator):
    def __init__(self, *, index=None, **kwargs):
        super().__init__(**kwargs)
        self.index = index

    def execute(self, context):
        if self.index % {fire_every} == 0:
            # Spread over the window by run and map index, each its own moment (equal moments
            # would share a trigger).
            task = context["logical_date"].timestamp() // 60 * {per_run} + self.index
            share = task * 0.6180339887 % 1
            moment = FIRE_AT + dt.timedelta(seconds={fire_spread} * share, microseconds=self.index)
        else:
            moment = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
        self.defer(trigger=DateTimeTrigger(moment), method_name="resume")

    def resume(self, context, event):
        return event.isoformat()


with DAG(
    {dag_id!r},
    schedule={schedule},
    start_date=dt.datetime.fromisoformat({start!r}),
    end_date=dt.datetime.fromisoformat({end!r}),
    catchup=True,
    max_active_runs={runs},
    max_active_tasks={per_run},
) as dag:
    Wait.partial(task_id="wait").expand(index=list(range({per_run})))
"""

INTERVAL = dt.timedelta(minutes=1)


def write_waits_dag(
    stack: Stack, args: argparse.Namespace, runs: int, fire_at: dt.datetime
) -> None:
    """The DAG, with a schedule of ``runs`` minute intervals ending before now (all due: the
    scheduler catches them up) unless ``--via-api`` (then no schedule: runs come from
    :meth:`Stack.trigger`)."""
    now = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    start = now - INTERVAL * (runs + 1)
    stack.write_dag(
        DAG_ID,
        WAITS_DAG.format(
            dag_id=DAG_ID,
            fire_at=fire_at.isoformat(),
            fire_every=args.fire_every,
            fire_spread=args.fire_spread,
            per_run=args.per_run,
            runs=runs,
            schedule="None" if args.via_api else "dt.timedelta(minutes=1)",
            start=start.isoformat(),
            end=(start + INTERVAL * (runs - 1)).isoformat(),
        ),
    )
    if args.via_api:
        stack.trigger(DAG_ID, [f"api{i}" for i in range(runs)])


def deferrals_per_tenth(stack: Stack) -> tuple[list[float], float]:
    """Deferrals per second in each tenth of the deferrals (by time), and the seconds from the
    first task picked up to the last deferral."""
    with stack.sessions() as session:
        rows = session.execute(
            text(
                "SELECT tenth, count(*), min(at), max(at) FROM ("
                " SELECT c.at, ntile(10) OVER (ORDER BY c.at) AS tenth"
                " FROM task_state_change c JOIN task_instance ti ON ti.id = c.task_instance_id"
                " WHERE ti.dag_id = :dag AND c.from_state = 'running' AND c.to_state = 'deferred'"
                ") d GROUP BY tenth ORDER BY tenth"
            ),
            {"dag": DAG_ID},
        ).all()
        first_start = session.scalar(
            text(
                "SELECT min(c.at) FROM task_state_change c"
                " JOIN task_instance ti ON ti.id = c.task_instance_id"
                " WHERE ti.dag_id = :dag AND c.to_state = 'running'"
            ),
            {"dag": DAG_ID},
        )
    rates, previous = [], first_start
    for _, count, _, last in rows:
        rates.append(count / max((last - previous).total_seconds(), 1e-3))
        previous = last
    return rates, (rows[-1][3] - first_start).total_seconds()


def fired_share(stack: Stack) -> tuple[int, int, int, list[float]]:
    """(tasks resumed, resumes of them, tasks resumed more than once, fire -> SCHEDULED in
    seconds of each, from the moment it returned)."""
    with stack.sessions() as session:
        resumed, resumes, twice = session.execute(
            text(
                "SELECT count(*), coalesce(sum(n), 0), count(*) FILTER (WHERE n > 1) FROM ("
                " SELECT c.task_instance_id, count(*) AS n FROM task_state_change c"
                " JOIN task_instance ti ON ti.id = c.task_instance_id"
                " WHERE ti.dag_id = :dag AND c.from_state = 'deferred'"
                " AND c.to_state = 'scheduled' GROUP BY 1) r"
            ),
            {"dag": DAG_ID},
        ).one()
        lateness = session.scalars(
            text(
                "SELECT extract(epoch FROM c.at - (x.value #>> '{}')::timestamptz)"
                " FROM task_state_change c JOIN task_instance ti ON ti.id = c.task_instance_id"
                " JOIN xcom x ON x.task_instance_id = ti.id AND x.key = 'return_value'"
                " WHERE ti.dag_id = :dag AND c.from_state = 'deferred'"
                " AND c.to_state = 'scheduled'"
            ),
            {"dag": DAG_ID},
        ).all()
    return int(resumed), int(resumes), int(twice), [float(x) for x in lateness]


def task_states(stack: Stack) -> dict[str, int]:
    with stack.sessions() as session:
        return dict(
            session.execute(
                text("SELECT state, count(*) FROM task_instance WHERE dag_id = :dag GROUP BY 1"),
                {"dag": DAG_ID},
            ).all()
        )


def per_wait(sizes_after: dict[str, int], sizes_before: dict[str, int], n: int) -> str:
    grown = {name: size - sizes_before.get(name, 0) for name, size in sizes_after.items()}
    tables = sorted(
        ((name, size) for name, size in grown.items() if name != "database" and size > 0),
        key=lambda item: -item[1],
    )
    parts = ", ".join(f"{name} {size / n:.0f}" for name, size in tables[:8])
    return f"PostgreSQL bytes per wait by table (with indexes): {parts}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="tasks waiting at once")
    parser.add_argument("--per-run", type=int, default=1000, help="map indexes per run")
    parser.add_argument("--via-api", action="store_true", help="runs created as the API does")
    parser.add_argument("--horizon", type=float, default=600.0, help="far-timer horizon, s")
    parser.add_argument("--fire-every", type=int, default=100, help="one task in this many fires")
    parser.add_argument("--fire-after", type=float, help="s from start to the first fire")
    parser.add_argument("--fire-spread", type=float, default=120.0, help="s the fires spread over")
    parser.add_argument("--samples", type=int, default=10, help="probe runs per phase")
    parser.add_argument("--idle", type=float, default=30.0, help="s of CPU measured while idle")
    add_service_arguments(parser, concurrency=16)
    args = parser.parse_args()
    per_run = min(args.per_run, args.n)
    args.per_run = per_run
    runs = max(1, args.n // per_run)
    n = runs * per_run
    fire_count = runs * len(range(0, per_run, args.fire_every))
    # Long enough for the deferrals at a few hundred a second, then the horizon.
    fire_after = args.fire_after or args.horizon + max(120.0, n / 400)
    capacity = fire_count + 1000

    started = time.monotonic()
    fire_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=fire_after)
    env = {"DEFERRAL_FAR_TIMER_HORIZON_SEC": f"{args.horizon:g}"}
    with Stack(keep=args.keep_logs, max_map_length=per_run, extra_env=env) as stack:
        print(calibration(), load_average(), flush=True)
        names = ["scheduler1", "triggerer1"] + [f"worker{i + 1}" for i in range(args.workers)]
        stack.start("scheduler1")
        stack.start("triggerer1", "--capacity", str(capacity))
        for name in names[2:]:
            stack.start(name, "--concurrency", str(args.concurrency))
        stack.wait_started(*names)
        triggerer_pid = stack.procs["triggerer1"].pid
        stack.write_dag("bench_probe", PROBE_DAG.format(delay=1.0))
        stack.warm_up("bench_probe")  # first imports and connections
        alone = probe(stack, args.samples, "alone")
        rss_before = rss_kib(triggerer_pid)
        sizes_before = postgres_bytes(stack)
        redis_before = redis_bytes(stack)

        cpu, rows = CpuMeter(stack), RowMeter(stack)
        cpu.start()
        rows.start()
        begun = time.monotonic()
        write_waits_dag(stack, args, runs, fire_at)
        last_said = 0.0

        def all_deferred() -> bool:
            nonlocal last_said
            deferred = task_states(stack).get("deferred", 0)
            if time.monotonic() - last_said > 30:
                print(
                    f"  {deferred} of {n} deferred after {time.monotonic() - begun:.0f} s",
                    flush=True,
                )
                last_said = time.monotonic()
            return deferred + stack.reached("success", DAG_ID) >= n

        wait_for(all_deferred, timeout=6 * 3600, interval=2.0, what=f"{n} tasks to defer")
        to_all_deferred = time.monotonic() - begun
        cpu.stop()
        rows.stop()
        deferring_cpu = cpu.lines(n, "deferral")
        wrote = rows.lines(n, "deferral")
        rates, window = deferrals_per_tenth(stack)
        print(f"all {n} deferred {to_all_deferred:.0f} s after the DAG was written", flush=True)
        if time.monotonic() - started > fire_after - args.horizon:
            print("  (some of the fired share may have come near before all deferred)")

        stack.vacuum_analyze()
        sizes_after = postgres_bytes(stack)
        redis_after = redis_bytes(stack)
        rss_waiting = rss_kib(triggerer_pid)
        held_waiting = stack.pending_triggers().count
        idle = CpuMeter(stack)
        idle.start()
        time.sleep(args.idle)  # what the waits cost while nothing happens: the measured span
        idle.stop()
        crowded = probe(stack, args.samples, "crowded")

        # The fired share comes within the horizon: published, held, fired.
        held_at = fire_at - dt.timedelta(seconds=5)
        wait_for(
            lambda: dt.datetime.now(dt.UTC) >= held_at,
            timeout=fire_after + 60,
            interval=1.0,
            what="the fired share to come near",
        )
        held_near = stack.pending_triggers().count
        rss_near = rss_kib(triggerer_pid)
        firing = CpuMeter(stack)
        firing.start()
        wait_for(
            lambda: stack.reached("success", DAG_ID) >= fire_count,
            timeout=args.fire_spread + 600,
            interval=2.0,
            what=f"the {fire_count} fired tasks to succeed",
        )
        firing.stop()
        time.sleep(5)  # a second resume of any of them would show by now
        resumed, resumes, twice, lateness = fired_share(stack)
        states = task_states(stack)

    n_f = max(fire_count, 1)
    # Held timers of the fired share may already be held when all have deferred: counted from
    # the start, so the far timers' cost (none) is in it too.
    rss_per_held = (rss_near - rss_before) * 1024 / max(held_near, 1)
    ok = report(
        f"many_waits: {n} tasks waiting ({runs} run(s) of one task mapped over {per_run},"
        f" {'created through the API' if args.via_api else 'a caught-up schedule'});"
        f" horizon {args.horizon:g} s; {args.workers} worker(s) x {args.concurrency} slots,"
        " 1 scheduler, 1 triggerer",
        [
            Figure(f"time until all {n} deferred", to_all_deferred, "s"),
            Figure("deferrals per second (first picked up -> last deferred)", n / window, "/s"),
            Figure("alone: fire -> SCHEDULED p50", median(alone[0]), "ms"),
            Figure("alone: fire -> SUCCESS p50", median(alone[1]), "ms"),
            Figure(f"with {n} waiting: fire -> SCHEDULED p50", median(crowded[0]), "ms"),
            Figure(f"with {n} waiting: fire -> SUCCESS p50", median(crowded[1]), "ms"),
            Figure(
                "triggerer RSS growth per waiting task (with what it held then)",
                (rss_waiting - rss_before) * 1024 / n,
                "bytes",
            ),
            Figure(
                "triggerer RSS per held time trigger (its growth since the start / held)",
                rss_per_held,
                "bytes",
                512,
            ),
            Figure("Redis bytes per waiting task", (redis_after - redis_before) / n, "bytes", 300),
            Figure(
                "PostgreSQL bytes per waiting task (whole database)",
                (sizes_after["database"] - sizes_before["database"]) / n,
                "bytes",
            ),
            Figure(
                f"fired share: tasks resumed (of {fire_count})",
                resumed,
                "",
                fire_count,
                at_most=False,
            ),
            Figure("fired share: tasks resumed more than once", twice, "", 0),
            Figure("fired share: fire -> SCHEDULED p50", median(lateness or [0.0]) * 1000, "ms"),
            Figure(
                "fired share: fire -> SCHEDULED p99",
                percentile(lateness or [0.0], 0.99) * 1000,
                "ms",
            ),
        ],
        notes=[
            "deferrals per second in each tenth of N: "
            + ", ".join(f"{rate:.0f}" for rate in rates),
            per_wait(sizes_after, sizes_before, n),
            f"Redis: {redis_after - redis_before} bytes for the prefix's keys with {n} waiting"
            f" ({held_waiting} trigger entries pending in a triggerer)",
            f"triggerer RSS {rss_before / 1024:.1f} MiB before, {rss_waiting / 1024:.1f} MiB with"
            f" {n} waiting, {rss_near / 1024:.1f} MiB holding {held_near} near timers",
            *(f"deferring: {line}" for line in deferring_cpu),
            *(f"deferring: {line}" for line in wrote),
            *(f"idle {args.idle:g} s with {n} waiting: {line}" for line in idle.lines(n, "wait")),
            *(f"firing {fire_count}: {line}" for line in firing.lines(n_f, "fired task")),
            f"fired share: {resumes} resumes of {resumed} tasks; states now {states}",
        ],
    )
    raise SystemExit(0 if ok and resumed == fire_count and resumes == fire_count else 1)


if __name__ == "__main__":
    main()
