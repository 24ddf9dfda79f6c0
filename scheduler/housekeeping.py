"""The scheduler's housekeeping, each step run every so often by its loop: deferrals and input
requests past their timeouts, deadline misses, retries and reschedules due, history pruned, its
partitions made ahead, planner statistics kept up, and the deferred tasks' count per trigger
class for a scrape."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from deferral.dag import DAG
from deferral.runtime import metrics
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import hitl, partitions, retention, statistics, transitions, waits
from scheduler import deadlines

log = logging.getLogger("deferral.scheduler")

# Shared trigger rows the unwaited sweep reads per call (going round them all).
UNWAITED_PAGE = 1000

_DEFERRED_BY_CLASS_SQL = text(
    """
    SELECT t.classpath, count(*) FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id
    WHERE ti.state = 'deferred' GROUP BY t.classpath
    """
)


class Housekeeping:
    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine,
        sessions: sessionmaker[Session],
        cipher: Cipher,
        callbacks: ThreadPoolExecutor,
        dags: Callable[[], dict[str, DAG]],
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.sessions = sessions
        self.cipher = cipher
        self.callbacks = callbacks  # the threads DAG callbacks run in
        self.dags = dags  # the DAGs as last read
        # Where the sweep for unwaited shared triggers goes on (a trigger id; 0: the first).
        self._unwaited_after = 0

    def deferred_by_trigger_class(self) -> dict[str, int]:
        """Deferred tasks by their trigger's class, for a scrape (on the metrics thread)."""
        with self.sessions.begin() as session:
            session.execute(text("SET LOCAL statement_timeout = '5s'"))
            rows = session.execute(_DEFERRED_BY_CLASS_SQL).all()
        return {classpath: count for classpath, count in rows}

    def expire_deferrals(self) -> None:
        with self.sessions.begin() as session:
            expired = transitions.expire_deferrals(session, self.cipher)
        metrics.TRIGGER_TIMEOUTS.inc(len(expired))
        metrics.DEFERRAL_TIMEOUTS.inc(len(expired))
        if expired:
            log.info("deferral timed out for task instance(s) %s", expired)
        # Shared triggers whose last waiter left (timed out, cleared, marked), a page per call
        # in a transaction of its own.
        with self.sessions.begin() as session:
            dropped, self._unwaited_after = transitions.drop_unwaited(
                session, self._unwaited_after, UNWAITED_PAGE
            )
        if dropped:
            log.info("shared trigger(s) %s dropped: their last waiter left", dropped)

    def fire_wait_timers(self) -> None:
        """Composite waits whose timer is due (deferral.store.waits): a page per call."""
        with self.sessions.begin() as session:
            fired = waits.fire_due_timers(session, self.cipher)
        if fired:
            log.info("wait timer fired for task instance(s) %s", fired)

    def fail_missed_heartbeats(self) -> None:
        """Callback waits whose heartbeat is past due (deferral.store.waits): a page per call,
        each task failed (or retried) naming the heartbeat."""
        with self.sessions.begin() as session:
            failed = waits.fail_missed_heartbeats(session, self.cipher)
        if failed:
            log.info("callback heartbeat missed by task instance(s) %s", failed)

    def expire_input_requests(self) -> None:
        """Tasks awaiting input whose response timeout passed: their defaults, or a failure."""
        with self.sessions.begin() as session:
            expired = hitl.expire(session, self.cipher)
        metrics.HITL_TIMEOUTS.inc(len(expired))
        if expired:
            log.info("response timeout passed for task instance(s) %s", expired)

    def record_deadline_misses(self) -> None:
        """Runs past a DeadlineAlert's deadline: recorded once, their callbacks run off the loop."""
        with self.sessions.begin() as session:
            missed = deadlines.record_misses(session, self.dags(), dt.datetime.now(dt.UTC))
        metrics.DEADLINE_MISSES.inc(len(missed))
        if missed:
            log.warning("deadline missed by %s", [m.context["run_id"] for m in missed])
            self.callbacks.submit(deadlines.call_back, self.sessions, missed)

    def wake_due(self) -> None:
        with self.sessions.begin() as session:
            transitions.wake_due(session)

    def prune(self) -> None:
        if self.settings.prune_older_than is None:
            return
        pruned = retention.prune(self.sessions, self.settings.prune_older_than)
        if pruned.total:
            log.info("%s", pruned.describe())

    def analyze_changed_tables(self) -> None:
        """ANALYZE a hot table after bulk changes, so that plans follow what the tables hold,
        and vacuum the run counts after many folds."""
        analyzed = statistics.analyze_changed(self.sessions)
        if analyzed:
            log.info("analyzed %s after bulk changes", analyzed)
        if statistics.vacuum_counts(self.engine):
            log.info("vacuumed dag_run_count: its folds left more dead rows than live ones")

    def make_partitions(self) -> None:
        made = partitions.make_ahead(self.sessions)
        if made:
            log.info("made history partition(s) %s", ", ".join(made))
