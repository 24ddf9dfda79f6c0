"""The evaluation of marked runs: what may move on in each run something changed in.

Runs of DAGs ``decide.decidable_together`` (no mapping, no ``depends_on_past``) that this
scheduler has checked against their DAG are evaluated together: their undecided task instances
read in one statement, each run decided by the pure functions of ``scheduler.decide``, the moves
of one kind and reason made in one statement for all of them, their ends probed in one and
their marks cleared in one: a batch of 50 runs costs what one does (a caught-up schedule
marks hundreds of runs at once). Any other run is evaluated alone, in a savepoint of its own,
and so is every run of a batch that raised (scheduler/DECISIONS.md 3).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker import outbox
from broker.streams import StreamKeys
from deferral.authoring.callbacks import REASON_SUCCESS, REASON_TASK_FAILURE
from deferral.dag import DAG
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient
from deferral.states import DagRunState
from deferral.store import transitions
from deferral.store.tables import DagRun
from scheduler import decide, runstate, trigger_starts, waiting
from scheduler.dispatch import Dispatcher
from scheduler.waiting import new_task_instance

log = logging.getLogger("deferral.scheduler")

# Marked runs read per pass; at most RUN_BATCH of them evaluated alone (the others stay marked
# for the next pass): a run evaluated alone costs statements of its own, a batch does not.
MARKED_BATCH = 500
RUN_BATCH = 50
CHECKED_RUNS_KEPT = 100_000
# A marked run whose DAG this scheduler has not loaded is looked at again this much later (by
# any scheduler): soon enough for a new DAG's first run, rare enough for a broken DAG's runs.
MISSING_DAG_LOOK_AGAIN_SEC = 5.0


@dataclass
class Evaluated:
    """What one evaluation pass did, acted on once it commits."""

    finished: list[tuple[DAG, DagRun, bool, str]] = field(default_factory=list)
    scheduled: list[int] = field(default_factory=list)  # task instances it scheduled
    # Trigger entries of the tasks it started in the triggerer (a run whose evaluation is
    # rolled back leaves an entry whose trigger no task waits on: its triggerer drops it).
    started_staged: list[outbox.Staged] = field(default_factory=list)
    # Runs it found to have every task of their DAG: remembered only once it commits (a pass,
    # or a run's savepoint, rolled back also undid the task instances it added).
    checked: dict[int, DAG] = field(default_factory=dict)
    staged: list[outbox.Staged] = field(default_factory=list)  # queue entries, to flush


class RunEvaluator:
    """Evaluates marked runs (``evaluate``), remembering which runs have been checked against
    which DAG object."""

    def __init__(
        self,
        *,
        name: str,
        max_map_length: int,
        cipher: Cipher,
        keys: StreamKeys,
        dispatcher: Dispatcher,
        dag: Callable[[str], DAG | None],
    ) -> None:
        self.name = name
        self.max_map_length = max_map_length
        self.cipher = cipher
        self.keys = keys
        self.dispatcher = dispatcher
        self._dag = dag
        # Run id -> the DAG object the run was last found to have every task of.
        self._checked: dict[int, DAG] = {}

    def remember_checked(self, run_pk: int, dag: DAG) -> None:
        """Remember that run ``run_pk`` has a task instance of every task of ``dag``."""
        if len(self._checked) >= CHECKED_RUNS_KEPT:
            self._checked.clear()  # runs finished elsewhere leave entries: start again
        self._checked[run_pk] = dag

    def committed(self, done: Evaluated) -> None:
        """The pass that did ``done`` committed: remember what it checked."""
        for run_pk, checked in done.checked.items():
            self.remember_checked(run_pk, checked)

    def evaluate(self, session: Session) -> Evaluated | None:
        """Decide what may move on in up to MARKED_BATCH marked runs (at most RUN_BATCH of them
        evaluated alone); None if none is marked. The
        tasks that became ready are queued in this transaction, as resumed tasks are (the same
        decision: pools, priorities, max_active_tasks), not by a later dispatch pass."""
        runs = session.scalars(
            select(DagRun)
            .where(DagRun.evaluate_after <= func.now(), DagRun.state == DagRunState.RUNNING)
            .order_by(DagRun.evaluate_after)
            .limit(MARKED_BATCH)
            .with_for_update(skip_locked=True)
        ).all()
        if not runs:
            return None
        # A run in which nothing can be decided (its tasks run or wait on triggers) costs
        # three index probes, whatever its size: a run of 10,000 tasks is marked by each
        # success (scheduler/DECISIONS.md 13).
        probed = runstate.probes(session, [(run.dag_id, run.run_id) for run in runs])
        done = Evaluated()
        quiet: list[DagRun] = []
        together: list[tuple[DagRun, DAG, decide.RunProbes]] = []
        alone: list[tuple[DagRun, decide.RunProbes]] = []
        for run in runs:
            dag = self._dag(run.dag_id)
            probes = probed.get((run.dag_id, run.run_id), decide.RunProbes(False, False, False))
            checked = dag is not None and self._checked.get(run.id) is dag
            if dag is not None and not decide.needs_evaluation(probes, checked_against_dag=checked):
                quiet.append(run)
            elif dag is not None and checked and decide.decidable_together(dag):
                together.append((run, dag, probes))
            else:
                alone.append((run, probes))
        if together:
            batch = Evaluated()
            try:
                with session.begin_nested():
                    quiet += self._evaluate_together(session, together, batch)
            except Exception as exc:
                if is_transient(exc):
                    raise
                # Rolled back whole: each of its runs is evaluated alone, the one that raises
                # keeping its error.
                log.warning("evaluating %d runs together failed (%s)", len(together), exc)
                alone += [(run, probes) for run, _, probes in together]
            else:
                _add(done, batch)
        transitions.evaluated_many(session, quiet)
        left = {run.id for run, _ in alone[RUN_BATCH:]}  # still marked: the next pass's
        for run, probes in alone[:RUN_BATCH]:
            self._evaluate_alone(session, run, probes, done)
        # A run's depends_on_past tasks wait on the run before: what changed here may let
        # the next runs' go (no transition marks them, this pass does).
        for run in runs:
            if run.id in left:
                continue
            dag = self._dag(run.dag_id)
            if dag is not None:
                runstate.mark_next_runs(session, dag, run)
        done.staged = self.dispatcher.resumed(session, done.scheduled) + done.started_staged
        return done

    def _evaluate_together(
        self,
        session: Session,
        runs: Sequence[tuple[DagRun, DAG, decide.RunProbes]],
        done: Evaluated,
    ) -> list[DagRun]:
        """Evaluate ``runs`` (checked, of DAGs decidable together) in a constant number of
        statements; returns those that did not finish, to be unmarked."""
        advanced = waiting.advance_runs(
            session,
            [(run, dag) for run, dag, probes in runs if probes.waiting or probes.retries_undue],
        )
        by_dag: dict[str, tuple[DAG, list[int]]] = {}
        for run, dag, _ in runs:
            if run.id in advanced:
                by_dag.setdefault(run.dag_id, (dag, []))[1].extend(advanced[run.id].scheduled)
        for dag, scheduled in by_dag.values():
            # start_from_trigger tasks go to the triggerer now, not to the pools' queue.
            started, staged = trigger_starts.start_in_triggerer(
                session, dag, scheduled, self.cipher, self.keys
            )
            done.started_staged += staged
            done.scheduled += [ti for ti in scheduled if ti not in started]
        ending = [
            (run, dag)
            for run, dag, probes in runs
            if (run.id in advanced and advanced[run.id].moved) or not probes.unfinished
        ]
        outcomes = runstate.outcome_probes_of_runs(
            session, [(dag, run.dag_id, run.run_id) for run, dag in ending]
        )
        ended: set[int] = set()
        for run, dag in ending:
            unfinished, leaf_failed = outcomes[(run.dag_id, run.run_id)]
            outcome = decide.run_outcome(unfinished=unfinished, leaf_failed=leaf_failed)
            if outcome is not None:
                self._finish(session, dag, run, outcome, done)
                ended.add(run.id)
        return [run for run, _, _ in runs if run.id not in ended]

    def _evaluate_alone(
        self, session: Session, run: DagRun, probes: decide.RunProbes, done: Evaluated
    ) -> None:
        """Evaluate one run in a savepoint of its own: one run that raises does not stop the
        others (scheduler/DECISIONS.md 3)."""
        try:
            with session.begin_nested():
                self._evaluate(session, run, probes, done)
        except Exception as exc:
            if is_transient(exc):
                raise
            # One run that raises must not stop the others: say why, look again later.
            log.exception("evaluating run %s of DAG %s failed", run.run_id, run.dag_id)
            transitions.evaluated(session, run, error=f"{type(exc).__name__}: {exc}")
            done.checked.pop(run.id, None)

    def _evaluate(
        self, session: Session, run: DagRun, probes: decide.RunProbes, done: Evaluated
    ) -> None:
        dag = self._dag(run.dag_id)
        if dag is None:
            # Not loaded here (now), maybe by another scheduler: kept marked for a look soon by
            # whichever has it (scheduler/DECISIONS.md 36; fail_broken_runs ends it if none).
            transitions.evaluated(
                session,
                run,
                f"DAG {run.dag_id!r} is not loaded by scheduler {self.name} (yet)",
                again_after_sec=MISSING_DAG_LOOK_AGAIN_SEC,
            )
            return
        moved = 0
        if self._checked.get(run.id) is not dag:
            # Tasks added to the DAG file after the run started join the run, as in Airflow;
            # checked once per run and DAG object (the DagBag keeps the object of an unchanged
            # file), not on every change.
            wanted = {t.task_id: t for t in decide.tasks_of_run(dag, *run_dates(run))}
            missing = runstate.missing_tasks(session, run.dag_id, run.run_id, wanted)
            added = [new_task_instance(run, wanted[task_id]) for task_id in missing]
            if added:
                transitions.add_task_instances(session, run, added)
                moved += len(added)
            done.checked[run.id] = dag
        if probes.waiting or probes.retries_undue or moved:
            advanced = waiting.advance_run(session, run, dag, self.max_map_length)
            moved += advanced.moved
            # start_from_trigger tasks go to the triggerer now, not to the pools' queue.
            started, staged = trigger_starts.start_in_triggerer(
                session, dag, advanced.scheduled, self.cipher, self.keys
            )
            done.started_staged += staged
            done.scheduled += [ti for ti in advanced.scheduled if ti not in started]
        outcome = None
        if moved or not probes.unfinished:
            unfinished, leaf_failed = runstate.outcome_probes(session, dag, run.dag_id, run.run_id)
            outcome = decide.run_outcome(unfinished=unfinished, leaf_failed=leaf_failed)
        if outcome is not None:
            self._finish(session, dag, run, outcome, done)
        else:
            transitions.evaluated(session, run)

    def _finish(
        self, session: Session, dag: DAG, run: DagRun, outcome: DagRunState, done: Evaluated
    ) -> None:
        transitions.finish_dag_run(session, run, outcome)
        self._checked.pop(run.id, None)
        done.checked.pop(run.id, None)
        log.info("run %s of DAG %s finished: %s", run.run_id, run.dag_id, outcome)
        success = outcome == DagRunState.SUCCESS
        done.finished.append(
            (dag, run, success, REASON_SUCCESS if success else REASON_TASK_FAILURE)
        )


def _add(into: Evaluated, part: Evaluated) -> None:
    into.finished += part.finished
    into.scheduled += part.scheduled
    into.started_staged += part.started_staged
    into.checked |= part.checked


def run_dates(run: DagRun) -> tuple[str, dt.datetime | None]:
    """What of a run decides which tasks it gets (``decide.tasks_of_run``)."""
    return run.run_type, run.logical_date
