"""Keeping the ``dag`` and ``import_error`` tables in step with what the DAGs folder holds, and
failing the runs of DAGs that stopped loading once their grace period is over.

A DAG that stops loading (its file fails to import, or no file defines it any more) is not
failed at once: a file being edited often breaks for a moment. ``dag.missing_since`` says since
when; after ``DEFERRAL_DAG_IMPORT_GRACE_SEC`` its running runs fail their unfinished tasks with
the reason, and ``deferral doctor`` shows the DAG meanwhile.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Collection

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.loading.dagbag import FolderContents
from deferral.loading.parsing import Parsed
from deferral.runtime import metrics
from deferral.states import DagRunState, TaskState
from deferral.store import serialized_dags, transitions
from deferral.store.tables import Dag, DagImportError, DagRun, TaskInstance
from scheduler import dagruns

log = logging.getLogger("deferral.scheduler")


def record(session: Session, folder: str, parsed: Parsed) -> list[str]:
    """Record a parse of ``folder``: each DAG's schedule and next run (``dagruns.sync_dags``),
    its ``dag`` row and the import errors (``sync``), and the documents the web UI and the CLI
    read (``serialized_dags.write``: only the changed ones; those of DAGs no longer loaded
    removed). Returns the ids of DAGs that load again after having been missing."""
    dagruns.sync_dags(session, parsed, dt.datetime.now(dt.UTC), parsed.pending)
    back = sync(session, parsed, parsed.pending)
    serialized_dags.write(session, folder, parsed.dags, parsed.pending)
    return back


def sync(session: Session, dagbag: FolderContents, pending: Collection[str] = ()) -> list[str]:
    """Record what the last parse found (the DAGs and import errors of the files ``pending``,
    which an interim read has not read yet, are left as they are); return the ids of DAGs
    that load again after having been missing (their runs need a look)."""
    now = func.now()
    loaded = dagbag.dags
    if loaded:
        rows = [
            {
                "dag_id": dag.dag_id,
                "fileloc": dag.fileloc,
                "max_active_tasks": dag.max_active_tasks,
                "is_active": True,
                "missing_since": None,
                "missing_reason": None,
                "last_parsed_at": now,
            }
            for dag in loaded.values()
        ]
        statement = insert(Dag).values(rows)
        back = list(
            session.scalars(
                select(Dag.dag_id).where(
                    Dag.dag_id.in_(list(loaded)), Dag.missing_since.is_not(None)
                )
            )
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=[Dag.dag_id],
                set_={k: statement.excluded[k] for k in rows[0] if k != "dag_id"},
            )
        )
    else:
        back = []
    errors = dagbag.import_errors
    metrics.DAG_IMPORT_ERRORS.set(len(errors))
    for dag in session.scalars(select(Dag).where(Dag.is_active, Dag.dag_id.not_in(list(loaded)))):
        if dag.fileloc in pending:
            continue
        reason = errors.get(dag.fileloc or "") or f"no longer defined in {dag.fileloc}"
        if dag.missing_since is None:
            dag.missing_since = now
            log.error("DAG %s cannot be loaded: %s", dag.dag_id, reason)
        dag.missing_reason = reason
    for filename, error in errors.items():
        statement = insert(DagImportError).values(filename=filename, error=error)
        session.execute(
            statement.on_conflict_do_update(
                index_elements=[DagImportError.filename], set_={"error": error, "last_seen": now}
            )
        )
    session.execute(
        delete(DagImportError).where(DagImportError.filename.not_in([*errors, *pending]))
    )
    return back


# Runs of a DAG that stopped loading failed per call (a few statements each): a DAG with a
# hundred thousand waiting runs is failed over many calls, none of which holds the loop long.
BROKEN_RUNS_PER_CALL = 200


def fail_broken_runs(session: Session, grace: dt.timedelta) -> list[tuple[str, str]]:
    """Fail the unfinished tasks of running runs whose DAG has not loaded for longer than
    ``grace``, and finish those runs once no attempt of theirs is still running: at most
    BROKEN_RUNS_PER_CALL runs of each such DAG per call, the rest at the next ones."""
    broken = session.execute(
        select(Dag.dag_id, Dag.missing_reason).where(Dag.missing_since < func.now() - grace)
    ).all()
    failed: list[tuple[str, str]] = []
    for dag_id, reason in broken:
        runs = session.scalars(
            select(DagRun)
            .where(DagRun.dag_id == dag_id, DagRun.state == DagRunState.RUNNING)
            .order_by(DagRun.id)
            .limit(BROKEN_RUNS_PER_CALL)
            .with_for_update(skip_locked=True)
        ).all()
        for run in runs:
            message = f"DAG {dag_id} cannot be loaded: {reason}"
            transitions.fail_unfinished(session, dag_id, run.run_id, message)
            still_running = session.scalar(
                select(func.count()).where(
                    TaskInstance.dag_id == dag_id,
                    TaskInstance.run_id == run.run_id,
                    TaskInstance.state == TaskState.RUNNING,
                )
            )
            if not still_running:
                transitions.finish_dag_run(session, run, DagRunState.FAILED)
                failed.append((dag_id, run.run_id))
                log.error("run %s of DAG %s failed: %s", run.run_id, dag_id, message)
    return failed


def runs_of(session: Session, dag_ids: list[str]) -> list[int]:
    """Running runs of these DAGs."""
    if not dag_ids:
        return []
    return list(
        session.scalars(
            select(DagRun.id).where(DagRun.dag_id.in_(dag_ids), DagRun.state == DagRunState.RUNNING)
        )
    )


def grace_left(session: Session, dag_id: str) -> bool:
    """Whether ``dag_id`` is known and only missing for now (its runs wait for it)."""
    return bool(
        session.scalar(
            select(func.count()).where(Dag.dag_id == dag_id, Dag.missing_since.is_not(None))
        )
    )
