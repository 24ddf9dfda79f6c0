"""Dispatch: scheduled -> queued, for the tasks their pool and their run's max_active_tasks let
through, highest priority first (resumed tasks ahead of new work of equal weight), each queued
with its queue entry staged in the outbox (published once the transaction commits). The
dispatch pass (:meth:`Dispatcher.scheduled`) and the resumed tasks (:meth:`Dispatcher.resumed`,
in the transaction that resumed them) make the same decision (``scheduler.decide``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from sqlalchemy import text
from sqlalchemy.orm import Session

from broker import outbox
from broker.streams import StreamKeys, queue_message
from deferral.dag import DAG
from deferral.runtime.crypto import Cipher
from deferral.store import pools, transitions
from scheduler import decide

DISPATCH_BATCH = 2000
DISPATCH_PASSES = 8
DEFAULT_MAX_ACTIVE_TASKS = 16

# The resumed tasks still scheduled (locked; one another scheduler holds is skipped), then their
# runs, locked in id order (as every statement that marks runs locks them), then the names of
# their pools, locked. The runs' queued and running tasks and the pools' free slots are counted
# by the next statements, whose snapshots hold what the locks' last holders queued: counted
# here, before the locks were had, two schedulers resuming tasks of one run each missed the
# other's and overran its max_active_tasks. Rows of kinds rather than a join: the planner
# cannot estimate the locked rows.
_RESUMED_READY_SQL = text(
    """
    WITH ready AS MATERIALIZED (
        SELECT id, dag_id, run_id, pool, pool_slots, priority_weight,
            next_method IS NOT NULL AS resumed
        FROM task_instance
        WHERE id = ANY(CAST(:ids AS bigint[])) AND state = 'scheduled'
        FOR UPDATE SKIP LOCKED
    ), runs AS MATERIALIZED (
        SELECT dag_id, run_id FROM dag_run
        WHERE (dag_id, run_id) IN (SELECT dag_id, run_id FROM ready)
        ORDER BY id
        FOR UPDATE
    ), pools AS ("""
    + pools.LOCK_POOLS_OF_READY
    + """)
    SELECT 'task' AS kind, id, dag_id, run_id, pool, pool_slots, priority_weight, resumed
    FROM ready
    UNION ALL
    SELECT 'run', NULL, dag_id, run_id, NULL, NULL, NULL, NULL FROM runs
    UNION ALL
    SELECT 'pool', NULL, NULL, NULL, name, NULL, NULL, NULL FROM pools
    """
)

# The queued and running tasks of each of these runs (by ix_task_instance_run_unfinished) and
# the free slots of these pools, all locked by the statement before: one round trip on every
# resume's path, not one per kind.
_RUNS_ACTIVE_AND_POOLS_FREE_SQL = text(
    """
    SELECT 'run' AS kind, t.dag_id, t.run_id, count(*) AS n
    FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[])) AS r (dag_id, run_id)
    JOIN task_instance AS t ON t.dag_id = r.dag_id AND t.run_id = r.run_id
    WHERE t.state IN ('queued', 'running')
    GROUP BY t.dag_id, t.run_id
    UNION ALL
    SELECT 'pool', free.name, NULL, free.free
    FROM ("""
    + pools.FREE_SLOTS_OF_NAMED
    + """) AS free
    """
)

# The dispatch pass's statements (:meth:`Dispatcher.scheduled`), plain SQL of a fixed
# shape: built with the ORM (a VALUES list of the pools' room, NOT IN lists that grow with the
# pass) each was compiled again every time, most of the scheduler's CPU while slots free up.
_ANY_SCHEDULED_SQL = text("SELECT id FROM task_instance WHERE state = 'scheduled' LIMIT 1")
_ACTIVE_SQL = text(
    """
    SELECT dag_id, run_id, count(*) AS active FROM task_instance
    WHERE state IN ('queued', 'running') GROUP BY dag_id, run_id
    """
)
# Up to :limit scheduled tasks in dispatch order (``decide.dispatch_key``, read through
# ix_task_instance_scheduled), of pools with room for them, leaving out the full runs and the
# tasks already chosen.
_DISPATCHABLE_SQL = """
    SELECT ti.id, ti.dag_id, ti.run_id, ti.pool, ti.pool_slots, ti.priority_weight,
        ti.next_method IS NOT NULL AS resumed
    FROM task_instance AS ti
    JOIN unnest(CAST(:pools AS text[]), CAST(:frees AS integer[])) AS room (pool, free)
        ON room.pool = ti.pool AND ti.pool_slots <= room.free
    WHERE ti.state = 'scheduled'
        AND ti.id <> ALL(CAST(:chosen AS bigint[]))
        AND NOT EXISTS (
            SELECT 1 FROM unnest(CAST(:full_dags AS text[]), CAST(:full_runs AS text[]))
                AS f (dag_id, run_id)
            WHERE f.dag_id = ti.dag_id AND f.run_id = ti.run_id
        )
    ORDER BY ti.priority_weight DESC, {resumed_first} ti.id
    LIMIT :limit
    FOR UPDATE OF ti SKIP LOCKED
    """
_DISPATCHABLE_RESUMED_FIRST_SQL = text(
    _DISPATCHABLE_SQL.format(resumed_first="(ti.next_method IS NOT NULL) DESC,")
)
_DISPATCHABLE_OLDEST_FIRST_SQL = text(_DISPATCHABLE_SQL.format(resumed_first=""))


class Dispatcher:
    def __init__(
        self,
        keys: StreamKeys,
        cipher: Cipher,
        dag: Callable[[str], DAG | None],
        *,
        resumed_first: bool,
    ) -> None:
        self.keys = keys
        self.cipher = cipher
        self.dag = dag  # the DAG of an id as last read (None: it does not load now)
        # DEFERRAL_RESUMED_FIRST: resumed tasks go ahead of new work of equal weight.
        self.resumed_first = resumed_first

    def scheduled(self, session: Session) -> list[outbox.Staged]:
        """scheduled -> queued for the scheduled tasks (of any run) that their pool and their
        run's max_active_tasks allow, highest priority first; returns the outbox rows of their
        queue entries.

        As Airflow does, what cannot go is left out of the query rather than read and skipped
        (:meth:`_dispatchable`), and no more tasks are read than the pools have slots: a backlog
        of scheduled tasks behind full pools costs a loop nothing but a count."""
        if session.scalar(_ANY_SCHEDULED_SQL) is None:
            return []
        pool_free = pools.free_slots(session)
        active = {(row.dag_id, row.run_id): row.active for row in session.execute(_ACTIVE_SQL)}
        budget = {
            run: decide.dispatch_budget(self._max_active_tasks(run[0]), count)
            for run, count in active.items()
        }
        chosen: list[int] = []
        # Each pass queues at least the first task it reads; a run that one pass fills is left
        # out of the next, so runs of small max_active_tasks do not hold the pools' room back.
        for _ in range(DISPATCH_PASSES):
            room = {name: free for name, free in pool_free.items() if free > 0}
            limit = min(DISPATCH_BATCH - len(chosen), sum(room.values()))
            if limit <= 0:
                break
            full = [run for run, left in budget.items() if left <= 0]
            ready = self._dispatchable(session, room, full, chosen, limit)
            for task in ready:
                if task.run not in budget:
                    budget[task.run] = self._max_active_tasks(task.run[0])
            plan = decide.plan_dispatch(ready, budget, pool_free, resumed_first=self.resumed_first)
            chosen += plan.chosen
            pool_free, budget = plan.pool_free, plan.run_budget
            if len(ready) < limit:
                break  # read every task that could go
        return self._queue(session, chosen)

    def resumed(self, session: Session, ids: Sequence[int]) -> list[outbox.Staged]:
        """:meth:`scheduled` for the tasks just resumed (``ids``), in the transaction that
        resumed them: their rows, locked with their runs and pools; the runs' active counts with
        the pools' free slots; the move. Plain SQL, a fixed number of statements: this is on
        every resume's path."""
        if not ids:
            return []
        ready: list[decide.Ready] = []
        for row in session.execute(_RESUMED_READY_SQL, {"ids": list(ids)}):
            # The other kinds of rows are the runs and pools it locked.
            if row.kind == "task":
                run = (row.dag_id, row.run_id)
                ready.append(
                    decide.Ready(
                        row.id, run, row.pool, row.pool_slots, row.priority_weight, row.resumed
                    )
                )
        if not ready:
            return []
        runs = sorted({task.run for task in ready})
        params = {
            "dag_ids": [r[0] for r in runs],
            "run_ids": [r[1] for r in runs],
            "names": sorted({task.pool for task in ready}),
        }
        active: dict[decide.RunKey, int] = {}
        pool_free: dict[str, int] = {}
        for row in session.execute(_RUNS_ACTIVE_AND_POOLS_FREE_SQL, params):
            if row.kind == "run":
                active[(row.dag_id, row.run_id)] = row.n
            else:
                pool_free[row.dag_id] = int(row.n)  # the pool's name, in the first column
        budget = {
            task.run: decide.dispatch_budget(
                self._max_active_tasks(task.run[0]), active.get(task.run, 0)
            )
            for task in ready
        }
        chosen = decide.choose_dispatch(ready, budget, pool_free, resumed_first=self.resumed_first)
        return self._queue(session, chosen)

    def _queue(self, session: Session, chosen: Sequence[int]) -> list[outbox.Staged]:
        """Move the ``chosen`` tasks to queued and stage their queue entries."""
        if not chosen:
            return []
        messages = [
            (
                self.keys.queue(row.queue),
                queue_message(
                    self.cipher,
                    row.id,
                    row.try_number,
                    row.dag_id,
                    row.run_id,
                    row.task_id,
                    row.map_index,
                ),
            )
            for row in transitions.dispatch(session, chosen)
        ]
        return outbox.stage_many(session, messages)

    def _dispatchable(
        self,
        session: Session,
        room: Mapping[str, int],
        full: Sequence[decide.RunKey],
        chosen: Sequence[int],
        limit: int,
    ) -> list[decide.Ready]:
        """Up to ``limit`` scheduled tasks, highest priority first, leaving out what cannot go:
        tasks of pools without ``room`` for them, of ``full`` runs, and those already
        ``chosen``; so the first one read can always go."""
        params = {
            "pools": sorted(room),
            "frees": [room[name] for name in sorted(room)],
            "full_dags": [run[0] for run in full],
            "full_runs": [run[1] for run in full],
            "chosen": list(chosen),
            "limit": limit,
        }
        statement = (
            _DISPATCHABLE_RESUMED_FIRST_SQL
            if self.resumed_first
            else _DISPATCHABLE_OLDEST_FIRST_SQL
        )
        return [
            decide.Ready(
                row.id,
                (row.dag_id, row.run_id),
                row.pool,
                row.pool_slots,
                row.priority_weight,
                row.resumed,
            )
            for row in session.execute(statement, params)
        ]

    def _max_active_tasks(self, dag_id: str) -> int:
        dag = self.dag(dag_id)
        return DEFAULT_MAX_ACTIVE_TASKS if dag is None else dag.max_active_tasks
