"""What a run's evaluation reads, sized by what changed, never by the run.

Every statement here is a probe of the run's unfinished task instances through the partial index
``ix_task_instance_run_unfinished`` (a few index entries whatever the run's size), or reads the
task instances that wait (state none, or a retry without its due time) and the *counts* of the
states of their direct upstream tasks. A run of 10,000 tasks that runs or waits on triggers costs
its evaluation one probe statement for the whole batch of marked runs; a reduce waiting on a task
mapped over 10,000 reads one row per state of that task, not 10,000 rows.

Plain SQL (``text()``), fixed in shape: these run for every marked run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import text
from sqlalchemy.orm import Session

from deferral.authoring import setup_teardown
from deferral.authoring.mappedoperator import MappedOperator
from deferral.dag import DAG
from deferral.states import TaskState
from deferral.store.tables import DagRun
from scheduler import decide

# Spelled as the partial index's predicate, so that the planner always uses it.
_UNFINISHED = "state NOT IN ('success', 'failed', 'skipped', 'upstream_failed', 'removed')"

# Per run, three probes of its unfinished task instances: one waits on its trigger rule, a retry
# needs its due time, anything is unfinished at all.
_PROBES_SQL = text(
    f"""
    SELECT r.dag_id, r.run_id,
        EXISTS (SELECT 1 FROM task_instance AS t
                WHERE t.dag_id = r.dag_id AND t.run_id = r.run_id AND t.state = 'none'
                  AND t.{_UNFINISHED}) AS waiting,
        EXISTS (SELECT 1 FROM task_instance AS t
                WHERE t.dag_id = r.dag_id AND t.run_id = r.run_id AND t.state = 'up_for_retry'
                  AND t.due_at IS NULL AND t.{_UNFINISHED}) AS retries_undue,
        EXISTS (SELECT 1 FROM task_instance AS t
                WHERE t.dag_id = r.dag_id AND t.run_id = r.run_id
                  AND t.{_UNFINISHED}) AS unfinished
    FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[])) AS r (dag_id, run_id)
    """
)

# The DAG's tasks that have no task instance in the run (added to the DAG file after the run
# started): one index probe per task of the DAG, read only when this scheduler has not checked
# the run against this DAG yet.
_MISSING_SQL = text(
    """
    SELECT t.task_id FROM unnest(CAST(:task_ids AS text[])) AS t (task_id)
    WHERE NOT EXISTS (SELECT 1 FROM task_instance AS ti
                      WHERE ti.dag_id = :dag_id AND ti.run_id = :run_id
                        AND ti.task_id = t.task_id)
    """
)

# The task instances the evaluation of these runs may move: waiting (none) and retries without
# a due time. One statement for a batch of runs, an index probe of each.
_UNDECIDED_SQL = text(
    f"""
    SELECT t.dag_id, t.run_id, t.id, t.task_id, t.map_index, t.state, t.due_at, t.end_date
    FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[])) AS r (dag_id, run_id)
    JOIN task_instance AS t ON t.dag_id = r.dag_id AND t.run_id = r.run_id
    WHERE t.{_UNFINISHED}
      AND (t.state = 'none' OR (t.state = 'up_for_retry' AND t.due_at IS NULL))
    """
)

# How many task instances of each (run, task) asked for are in each state (waiting ones
# excepted: they are read as rows), the unexpanded placeholder of a mapped task (map index -1)
# apart.
_UPSTREAM_COUNTS_SQL = text(
    """
    SELECT t.dag_id, t.run_id, t.task_id, t.state, t.map_index < 0 AS placeholder,
        count(*) AS n
    FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[]), CAST(:task_ids AS text[]))
        AS u (dag_id, run_id, task_id)
    JOIN task_instance AS t
        ON t.dag_id = u.dag_id AND t.run_id = u.run_id AND t.task_id = u.task_id
    WHERE t.state <> 'none'
    GROUP BY t.dag_id, t.run_id, t.task_id, t.state, t.map_index < 0
    """
)

# The task instances of these (run, task), one row each (waiting ones excepted): the upstream
# tasks of a mapped task group's tasks in the same group, counted by map index.
_UPSTREAM_ROWS_SQL = text(
    """
    SELECT t.dag_id, t.run_id, t.task_id, t.map_index, t.state
    FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[]), CAST(:task_ids AS text[]))
        AS u (dag_id, run_id, task_id)
    JOIN task_instance AS t
        ON t.dag_id = u.dag_id AND t.run_id = u.run_id AND t.task_id = u.task_id
    WHERE t.state <> 'none'
    """
)

# Per run (its place in the arrays, from 1), whether anything of it is unfinished, and only if
# not, whether a task instance of one of its leaves (:leaf_runs names the run of each of
# :leaf_ids) failed: the second probe is never executed while the run has work left.
_OUTCOME_SQL = text(
    f"""
    WITH runs AS (
        SELECT r.place, r.dag_id, r.run_id,
            EXISTS (SELECT 1 FROM task_instance AS t
                    WHERE t.dag_id = r.dag_id AND t.run_id = r.run_id
                      AND t.{_UNFINISHED}) AS unfinished
        FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[]))
            WITH ORDINALITY AS r (dag_id, run_id, place)
    )
    SELECT runs.dag_id, runs.run_id, runs.unfinished,
        CASE WHEN runs.unfinished THEN false
             ELSE EXISTS (
                SELECT 1
                FROM unnest(CAST(:leaf_runs AS bigint[]), CAST(:leaf_ids AS text[]))
                    AS l (place, task_id)
                JOIN task_instance AS t
                    ON t.dag_id = runs.dag_id AND t.run_id = runs.run_id
                   AND t.task_id = l.task_id
                WHERE l.place = runs.place AND t.state IN ('failed', 'upstream_failed'))
        END AS leaf_failed
    FROM runs
    """
)

# depends_on_past: the run before this one (the previous scheduled or backfill run with
# catchup, as Airflow 2.10), found by the (dag_id, logical_date) key, and the states of the task
# instances of the tasks asked about in it, by the (dag_id, run_id, task_id) key: one row per
# task and state (a task mapped over 10,000 gives a row per state), none if there is no such
# run, a row without task if the run has none of them.
_PREVIOUS_RUN_SQL = text(
    """
    WITH previous AS (
        SELECT run_id, logical_date FROM dag_run
        WHERE dag_id = :dag_id AND logical_date < :logical_date
          AND (NOT :scheduled_only OR run_type <> 'manual')
        ORDER BY logical_date DESC LIMIT 1
    )
    SELECT p.logical_date, t.task_id, t.state FROM previous AS p
    LEFT JOIN task_instance AS t
        ON t.dag_id = :dag_id AND t.run_id = p.run_id
       AND t.task_id = ANY(CAST(:task_ids AS text[]))
    GROUP BY p.logical_date, t.task_id, t.state
    """
)

# ignore_first_depends_on_past: which of these tasks had a task instance in any earlier run.
# Read only for such a task that the previous run lacks (a task new to the DAG, once).
_RAN_EARLIER_SQL = text(
    """
    SELECT DISTINCT t.task_id FROM task_instance AS t
    JOIN dag_run AS r ON r.dag_id = t.dag_id AND r.run_id = t.run_id
    WHERE t.dag_id = :dag_id AND t.task_id = ANY(CAST(:task_ids AS text[]))
      AND r.logical_date < :logical_date
    """
)

# The runs whose depends_on_past tasks wait on this one: the next run; with catchup, the next
# scheduled or backfill run and the manual runs before it (their previous scheduled run is this
# one). Each is marked for evaluation when it has such a task waiting and this run's are past
# waiting themselves: a change here may let them run. A run whose own such tasks still wait
# marks nothing, so a change never walks the chain of waiting runs.
_MARK_NEXT_SQL = text(
    """
    WITH bound AS (
        SELECT min(logical_date) AS upto FROM dag_run
        WHERE dag_id = :dag_id AND logical_date > :logical_date
          AND (NOT :scheduled_only OR run_type <> 'manual')
    )
    UPDATE dag_run AS r
    SET evaluate_after = least(coalesce(r.evaluate_after, now()), now())
    FROM bound
    WHERE r.dag_id = :dag_id AND r.logical_date > :logical_date
      AND (r.logical_date <= bound.upto OR (bound.upto IS NULL AND :scheduled_only))
      AND r.state = 'running'
      AND EXISTS (SELECT 1 FROM task_instance AS t
                  WHERE t.dag_id = :dag_id AND t.run_id = r.run_id
                    AND t.task_id = ANY(CAST(:task_ids AS text[])) AND t.state = 'none')
      AND NOT EXISTS (SELECT 1 FROM task_instance AS t
                      WHERE t.dag_id = :dag_id AND t.run_id = :run_id
                        AND t.task_id = ANY(CAST(:task_ids AS text[])) AND t.state = 'none')
    """
)

# Map indexes given to the task instances an upstream count stands for: far above any real map
# index (DEFERRAL_MAX_MAP_LENGTH is an int), so they never meet a waiting row's.
_COUNTED_INDEX_BASE = 2**40


def probes(
    session: Session, runs: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], decide.RunProbes]:
    """The probes of each run (dag_id, run_id), in one statement."""
    if not runs:
        return {}
    params = {"dag_ids": [r[0] for r in runs], "run_ids": [r[1] for r in runs]}
    return {
        (row.dag_id, row.run_id): decide.RunProbes(row.waiting, row.retries_undue, row.unfinished)
        for row in session.execute(_PROBES_SQL, params)
    }


def missing_tasks(session: Session, dag_id: str, run_id: str, task_ids: Iterable[str]) -> list[str]:
    """The ``task_ids`` that have no task instance in the run."""
    params = {"dag_id": dag_id, "run_id": run_id, "task_ids": sorted(task_ids)}
    return list(session.scalars(_MISSING_SQL, params))


RunKey = tuple[str, str]  # (dag_id, run_id)


def undecided(session: Session, dag: DAG, dag_id: str, run_id: str) -> list[decide.RunTask]:
    """:func:`undecided_of_runs` of one run."""
    return undecided_of_runs(session, [(dag, dag_id, run_id)]).get((dag_id, run_id), [])


def undecided_of_runs(
    session: Session, runs: Sequence[tuple[DAG, str, str]]
) -> dict[RunKey, list[decide.RunTask]]:
    """For each run (its DAG, dag_id, run_id): the task instances its evaluation may move
    (waiting, retries without a due time), and what their trigger rules and expansions count:
    the states of their direct upstream tasks (and the tasks they map over, and their indirect
    setups), as counts. A counted task instance stands in ``RunTask`` with no id (it is never
    moved) and a map index of its own. The upstream tasks of a mapped task group's task in the
    same group are read as rows instead, with their map indexes
    (``decide.relevant_upstream_states``). At most three statements, whatever the runs."""
    if not runs:
        return {}
    found: dict[RunKey, list[decide.RunTask]] = {(d, r): [] for _, d, r in runs}
    params = {"dag_ids": [d for _, d, _ in runs], "run_ids": [r for _, _, r in runs]}
    for dag_id, run_id, *row in session.execute(_UNDECIDED_SQL, params):
        found[(dag_id, run_id)].append(decide.RunTask(*row))
    counted: list[tuple[str, str, str]] = []
    by_index: list[tuple[str, str, str]] = []
    for dag, dag_id, run_id in runs:
        upstream, rows_of = _upstream_of(dag, found[(dag_id, run_id)])
        counted += [(dag_id, run_id, task_id) for task_id in sorted(upstream)]
        by_index += [(dag_id, run_id, task_id) for task_id in sorted(rows_of)]
    if by_index:
        # Read as rows, which count as well as counts do for the other tasks waiting on them.
        for dag_id, run_id, task_id, map_index, state in session.execute(
            _UPSTREAM_ROWS_SQL, _triples(by_index)
        ):
            found[(dag_id, run_id)].append(
                decide.RunTask(None, task_id, map_index, state, None, None)
            )
    if not counted:
        return found
    next_index: dict[tuple[str, str, str], int] = {}
    for dag_id, run_id, task_id, state, placeholder, n in session.execute(
        _UPSTREAM_COUNTS_SQL, _triples(counted)
    ):
        rows = found[(dag_id, run_id)]
        if placeholder:
            rows.append(decide.RunTask(None, task_id, -1, state, None, None))
            continue
        first = next_index.get((dag_id, run_id, task_id), _COUNTED_INDEX_BASE)
        rows += [
            decide.RunTask(None, task_id, index, state, None, None)
            for index in range(first, first + n)
        ]
        next_index[(dag_id, run_id, task_id)] = first + n
    return found


def _upstream_of(dag: DAG, rows: Sequence[decide.RunTask]) -> tuple[set[str], set[str]]:
    """The tasks whose states the waiting ``rows`` of a run count: (read as counts, read as
    rows by map index)."""
    upstream: set[str] = set()
    by_index: set[str] = set()
    setups = setup_teardown.graph(dag)
    for task_id in {row.task_id for row in rows if row.state == TaskState.NONE}:
        task = dag.task_dict.get(task_id)
        if task is None:
            continue
        upstream |= task.upstream_task_ids | setups.indirect_setups(task)
        if isinstance(task, MappedOperator):
            upstream |= task.mapped_dependencies()
        members = decide.mapped_group_members(task)
        if members is not None:
            by_index |= task.upstream_task_ids & members
    return upstream - by_index, by_index


def _triples(keys: Sequence[tuple[str, str, str]]) -> dict[str, list[str]]:
    return {
        "dag_ids": [k[0] for k in keys],
        "run_ids": [k[1] for k in keys],
        "task_ids": [k[2] for k in keys],
    }


def outcome_probes(session: Session, dag: DAG, dag_id: str, run_id: str) -> tuple[bool, bool]:
    """(anything unfinished, a leaf task instance failed) of the run."""
    return outcome_probes_of_runs(session, [(dag, dag_id, run_id)])[(dag_id, run_id)]


def outcome_probes_of_runs(
    session: Session, runs: Sequence[tuple[DAG, str, str]]
) -> dict[RunKey, tuple[bool, bool]]:
    """(anything unfinished, a leaf task instance failed) of each run (its DAG, dag_id,
    run_id), in one statement."""
    if not runs:
        return {}
    leaf_runs: list[int] = []
    leaf_ids: list[str] = []
    for place, (dag, _, _) in enumerate(runs, start=1):
        leaves = sorted(setup_teardown.graph(dag).deciding_leaves)
        leaf_runs += [place] * len(leaves)
        leaf_ids += leaves
    params = {
        "dag_ids": [d for _, d, _ in runs],
        "run_ids": [r for _, _, r in runs],
        "leaf_runs": leaf_runs,
        "leaf_ids": leaf_ids,
    }
    return {
        (row.dag_id, row.run_id): (bool(row.unfinished), bool(row.leaf_failed))
        for row in session.execute(_OUTCOME_SQL, params)
    }


def previous_run(
    session: Session, dag: DAG, run: DagRun, task_ids: Iterable[str]
) -> decide.PreviousRun | None:
    """What ``depends_on_past`` reads of the run before ``run`` for these (waiting) tasks and,
    for those with ``wait_for_downstream``, their direct downstream tasks; None if there is no
    run before it. With ``catchup`` the run before is the previous scheduled or backfill run."""
    asked = set(task_ids)
    for task_id in list(asked):
        if dag.task_dict[task_id].wait_for_downstream:
            asked |= dag.task_dict[task_id].downstream_task_ids
    params = {
        "dag_id": dag.dag_id,
        "logical_date": run.logical_date,
        "scheduled_only": dag.catchup,
        "task_ids": sorted(asked),
    }
    rows = session.execute(_PREVIOUS_RUN_SQL, params).all()
    if not rows:
        return None
    states: dict[str, list[str]] = {}
    for _, task_id, state in rows:
        if task_id is not None:
            states.setdefault(task_id, []).append(state)
    first_ones = sorted(
        task_id
        for task_id in task_ids
        if task_id not in states and dag.task_dict[task_id].ignore_first_depends_on_past
    )
    ran_earlier: frozenset[str] = frozenset()
    if first_ones:
        ran_earlier = frozenset(
            session.scalars(_RAN_EARLIER_SQL, {**params, "task_ids": first_ones})
        )
    return decide.PreviousRun(rows[0].logical_date, states, ran_earlier)


def mark_next_runs(session: Session, dag: DAG, run: DagRun) -> None:
    """Mark the runs whose ``depends_on_past`` tasks wait on ``run`` (if any waits and
    ``run``'s own are past waiting): the change that marked ``run`` may let them run. Nothing
    for a DAG without such tasks, or for a manual run when runs wait on the previous scheduled
    one (``catchup``)."""
    task_ids = decide.past_dependent_tasks(dag)
    if not task_ids or (dag.catchup and run.run_type == "manual"):
        return
    session.execute(
        _MARK_NEXT_SQL,
        {
            "dag_id": dag.dag_id,
            "run_id": run.run_id,
            "logical_date": run.logical_date,
            "scheduled_only": dag.catchup,
            "task_ids": sorted(task_ids),
        },
    )
