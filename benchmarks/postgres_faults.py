"""PostgreSQL goes away and comes back under 500 deferring tasks: an immediate shutdown and
restart, the server stopped 30 s, a failover to a promoted replica.

    .venv/bin/python benchmarks/postgres_faults.py [--tasks 500] [--outage 30]

A private cluster (``tests/postgres_topologies.py``: a primary and a synchronous streaming
replica on spare ports; the shared server is not touched) and one stack on it: two schedulers,
two workers (4 slots each) and two triggerers (heartbeat 1 s), given both servers
(``host=a&host=b&target_session_attrs=read-write``). Each case triggers ``--tasks`` tasks (runs
of 50 that defer 3 s, then mark a file of their own), and once half have deferred, applies its
fault while the rest are queued, running, deferring and resuming. Printed per case:

- tasks that succeeded exactly once: one change to success in ``task_state_change`` and one
  mark by the task itself (target: all);
- services alive at the end (target: all six, none restarted);
- seconds from the server's return (the database's clock at its first answer) to the first task
  state change after it (target <= 10 s);
- tries failed by the fault and retried (counted, no target).

The failover comes last: the old primary stays down.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from harness import Figure, Stack, report, wait_for
from soak import SERVICES  # the soak's six processes
from sqlalchemy import func, select

from deferral.store.tables import TaskInstance, TaskStateChange
from tests.outage_runs import database_now, first_change_after, outage_dag, problems, run_finished
from tests.postgres_topologies import LocalPostgres, running

PER_RUN = 50


def retried(stack: Stack, dag_id: str) -> int:
    with stack.sessions() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(TaskStateChange)
                .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
                .where(TaskInstance.dag_id == dag_id, TaskStateChange.to_state == "up_for_retry")
            )
            or 0
        )


def through(stack: Stack, case: str, tasks: int, fault: Callable[[], None]) -> list[Figure]:
    out = stack.home / "out"
    out.mkdir(exist_ok=True)
    stack.write_dag(case, outage_dag(case, PER_RUN, out, seconds=3))
    runs = [f"r{i}" for i in range(tasks // PER_RUN)]
    stack.trigger(case, runs)
    wait_for(
        lambda: stack.reached("deferred", case) >= tasks // 2,
        timeout=600,
        interval=0.2,
        what="half the tasks deferred",
    )
    faulted = time.monotonic()
    fault()
    outage = time.monotonic() - faulted
    back = database_now(stack.sessions)
    resumed = wait_for(
        lambda: first_change_after(stack.sessions, case, back), timeout=600, what="work to resume"
    )
    wait_for(
        lambda: all(run_finished(stack.sessions, case, run) for run in runs),
        timeout=900,
        interval=0.5,
        what="every run to finish",
    )
    broken = [p for run in runs for p in problems(stack.sessions, case, run, PER_RUN, out)]
    for problem in broken[:10]:
        print(f"  {case} FAILED: {problem}")
    alive = sum(1 for name in SERVICES if stack.procs[name].poll() is None)
    print(
        f"{case}: server away {outage:.1f} s; {tasks - len(broken)}/{tasks} tasks ok exactly"
        f" once; {alive}/{len(SERVICES)} services alive; resumed"
        f" {(resumed - back).total_seconds():.2f} s after the return;"
        f" {retried(stack, case)} tries retried",
        flush=True,
    )
    return [
        Figure(f"{case}: tasks ok exactly once", tasks - len(broken), "tasks", tasks, False),
        Figure(f"{case}: services alive", alive, "services", len(SERVICES), False),
        Figure(f"{case}: return to first resume", (resumed - back).total_seconds(), "s", 10),
    ]


def faults(cluster: LocalPostgres, outage_sec: float) -> dict[str, Callable[[], None]]:
    """Each case's fault, returning once the server is back (the failover last)."""
    primary = cluster.primary_port

    def restart() -> None:
        cluster.stop_server(primary, "immediate")
        cluster.start_server(primary)

    def stopped() -> None:
        cluster.stop_server(primary, "fast")
        time.sleep(outage_sec)  # the outage itself: its length is the case
        cluster.start_server(primary)

    def failover() -> None:
        cluster.stop_server(primary, "immediate")
        cluster.promote()

    return {"pg_restart": restart, "pg_stopped": stopped, "pg_failover": failover}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=500, help=f"a multiple of {PER_RUN}")
    parser.add_argument("--outage", type=float, default=30.0, help="seconds stopped")
    args = parser.parse_args()
    figures: list[Figure] = []
    for cluster in running(LocalPostgres(replica=True)):
        with Stack(heartbeat_sec=1, admin_url=cluster.failover_url, prefix="bench_pg") as stack:
            for name, options in SERVICES.items():
                stack.start(name, *options)
            stack.wait_started(*SERVICES)
            for case, fault in faults(cluster, args.outage).items():
                figures += through(stack, case, args.tasks, fault)
    met = report(f"PostgreSQL faults, {args.tasks} deferring tasks per case", figures)
    raise SystemExit(0 if met else 1)


if __name__ == "__main__":
    main()
