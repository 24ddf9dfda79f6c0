"""``deferral doctor``: the stuck-deferred-task checklist, as pure decisions.

The CLI gathers counts and ages (from Postgres, measured with the database's clock, and from
Redis); each function here turns one set of numbers into a :class:`Check`: ok, warn or fail, with
a one-line detail saying what was found and what to do about it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    status: Status
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status}  {self.name}: {self.detail}"


# A deferral whose timeout passed is failed by the scheduler within about a second; one that
# passed longer ago than this means no scheduler is running.
EXPIRED_GRACE_SEC = 10.0
# The scheduler's outbox relay republishes rows left unpublished for 10 s, every 5 s; a row older
# than this means no scheduler is relaying.
OUTBOX_STALE_SEC = 30.0
# At most this many ids are listed in one line; the count is always given.
MAX_LISTED = 5
MAX_ERROR_CHARS = 200


def exit_code(checks: Iterable[Check]) -> int:
    """1 if any check failed, else 0 (warnings do not fail the doctor)."""
    return 1 if any(check.status is Status.FAIL for check in checks) else 0


def _plural(count: int, noun: str, plural: str | None = None) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {plural or noun + 's'}"


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    more = len(items) - MAX_LISTED
    return f"{shown}, and {more} more" if more > 0 else shown


def triggerer_alive(
    deferred: int,
    alive: Sequence[str],
    stale: Sequence[tuple[str, float]],
    stale_after_sec: float,
) -> Check:
    """Deferred tasks need at least one triggerer that is running and heartbeating.

    ``alive``: names of triggerers in state running with a heartbeat at most ``stale_after_sec``
    old; ``stale``: (name, heartbeat age in seconds) of every other triggerer row.
    """
    name = "triggerer alive"
    if alive:
        return Check(Status.OK, name, f"{_plural(len(alive), 'triggerer')} alive: {_listed(alive)}")
    last_seen = ""
    if stale:
        seen = [f"{n} {age:.0f}s ago" for n, age in sorted(stale, key=lambda s: s[1])]
        last_seen = f"; last heartbeats: {_listed(seen)}"
    if deferred == 0:
        return Check(Status.OK, name, f"no triggerer alive, but no task is deferred{last_seen}")
    return Check(
        Status.FAIL,
        name,
        f"{_plural(deferred, 'deferred task')} but no triggerer is alive (heartbeat within"
        f" {stale_after_sec:g}s){last_seen}: start `triggerer consume`",
    )


def capacity(deferred: int, alive_capacity: int, alive_triggerers: int) -> Check:
    """Warn when the alive triggerers together cannot run every deferred task's trigger."""
    name = "capacity"
    found = (
        f"{_plural(deferred, 'deferred task')}, capacity {alive_capacity}"
        f" on {_plural(alive_triggerers, 'alive triggerer')}"
    )
    if alive_capacity < deferred:
        return Check(
            Status.WARN,
            name,
            f"{found}: triggers beyond capacity wait; start more triggerers or raise --capacity",
        )
    return Check(Status.OK, name, found)


def expired_timeouts(expired: int, oldest_overdue_sec: float | None) -> Check:
    """Deferred tasks whose trigger_timeout passed more than EXPIRED_GRACE_SEC ago."""
    name = "expired timeouts"
    if expired == 0:
        return Check(
            Status.OK,
            name,
            f"no deferred task is past its trigger_timeout by more than {EXPIRED_GRACE_SEC:g}s",
        )
    oldest = "" if oldest_overdue_sec is None else f" (oldest by {oldest_overdue_sec:.0f}s)"
    return Check(
        Status.FAIL,
        name,
        f"{_plural(expired, 'deferred task')} past trigger_timeout{oldest}:"
        " no scheduler is failing them; start `scheduler consume`",
    )


def orphaned_triggers(orphan_trigger_ids: Sequence[int], stranded_tasks: Sequence[str]) -> Check:
    """Trigger rows no task waits on (warn: they only waste a triggerer slot), and deferred tasks
    whose trigger row is missing (fail: nothing will ever resume them but their timeout).

    ``stranded_tasks``: labels (dag.run.task) of deferred task instances without a trigger row.
    """
    name = "orphaned triggers"
    problems = []
    if stranded_tasks:
        problems.append(
            f"{_plural(len(stranded_tasks), 'deferred task')} without a trigger row"
            f" ({_listed(stranded_tasks)}): clear or mark them"
        )
    if orphan_trigger_ids:
        ids = [str(i) for i in orphan_trigger_ids]
        problems.append(f"{_plural(len(ids), 'trigger')} no task waits on (id {_listed(ids)})")
    if not problems:
        return Check(Status.OK, name, "every trigger has a waiting task and vice versa")
    status = Status.FAIL if stranded_tasks else Status.WARN
    return Check(status, name, "; ".join(problems))


def unpublished_outbox(unpublished: int, oldest_age_sec: float | None) -> Check:
    """Outbox rows left unpublished longer than OUTBOX_STALE_SEC: no scheduler relays them."""
    name = "unpublished outbox"
    if unpublished == 0:
        return Check(
            Status.OK, name, f"no outbox row unpublished for more than {OUTBOX_STALE_SEC:g}s"
        )
    oldest = "" if oldest_age_sec is None else f" (oldest {oldest_age_sec:.0f}s)"
    return Check(
        Status.FAIL,
        name,
        f"{_plural(unpublished, 'outbox row')} unpublished for more than"
        f" {OUTBOX_STALE_SEC:g}s{oldest}: no scheduler is relaying them; start `scheduler consume`",
    )


def dead_letters(stream: str, length: int, newest_error: str | None) -> Check:
    """Entries in the dead-letter stream: each is a task that failed on a bad entry."""
    name = "dead letters"
    if length == 0:
        return Check(Status.OK, name, f"{stream} is empty")
    error = (newest_error or "").strip().splitlines()
    first = error[0] if error else "(no error field)"
    if len(first) > MAX_ERROR_CHARS:
        first = first[: MAX_ERROR_CHARS - 3] + "..."
    return Check(
        Status.WARN,
        name,
        f"{_plural(length, 'entry', 'entries')} in {stream}; newest error: {first}",
    )


def in_flight(stranded_tasks: Sequence[str]) -> Check:
    """Deferred tasks whose trigger is in no stream (neither waiting or running in
    ``deferral:triggers`` nor fired into ``deferral:events``): nothing will resume them until the
    scheduler's reconciler publishes their trigger again.

    ``stranded_tasks``: labels (dag.run.task) of such task instances."""
    name = "in flight"
    if not stranded_tasks:
        return Check(Status.OK, name, "every deferred task's trigger is in a stream")
    return Check(
        Status.FAIL,
        name,
        f"{_plural(len(stranded_tasks), 'deferred task')} whose trigger is in no stream"
        f" ({_listed(stranded_tasks)}): a running scheduler republishes them within seconds;"
        " if this persists, start `scheduler consume`",
    )


@dataclass(frozen=True)
class BrokenDag:
    dag_id: str
    missing_for_sec: float
    reason: str
    running_runs: int


def broken_dags(broken: Sequence[BrokenDag], grace_sec: float) -> Check:
    """DAGs that stopped loading: their running runs fail after the grace period."""
    name = "broken DAGs"
    if not broken:
        return Check(Status.OK, name, "every DAG with runs loads")
    parts = []
    overdue = False
    for dag in broken:
        reason = dag.reason.strip().splitlines()[0] if dag.reason.strip() else "unknown"
        if len(reason) > MAX_ERROR_CHARS:
            reason = reason[: MAX_ERROR_CHARS - 3] + "..."
        left = grace_sec - dag.missing_for_sec
        runs = _plural(dag.running_runs, "running run")
        if left > 0:
            fate = f"{runs} fail in {left:.0f}s unless it loads again"
        else:
            fate = f"{runs} past the {grace_sec:g}s grace period"
            overdue = overdue or dag.running_runs > 0
        parts.append(f"{dag.dag_id} for {dag.missing_for_sec:.0f}s ({reason}): {fate}")
    status = Status.FAIL if overdue else Status.WARN
    return Check(status, name, f"{_plural(len(broken), 'DAG')} not loading: " + "; ".join(parts))


@dataclass(frozen=True)
class FailingFile:
    filename: str
    error: str


def import_errors(errors: Sequence[FailingFile]) -> Check:
    """DAG files the scheduler could not load (their DAGs cannot be triggered or scheduled)."""
    name = "import errors"
    if not errors:
        return Check(Status.OK, name, "every DAG file loads")
    parts = [f"{e.filename} ({_first_line(e.error)})" for e in errors]
    return Check(
        Status.WARN,
        name,
        f"{_plural(len(errors), 'DAG file')} failing to import: {_listed(parts)};"
        " `deferral dags list` shows each error",
    )


def _first_line(error: str) -> str:
    lines = error.strip().splitlines()
    line = lines[0] if lines else "unknown"
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."
