"""A trigger spec checked against its trigger row in PostgreSQL before it runs (the triggerer)
or is re-driven (``deferral dead retry``): the classpath, the task instance and the try. The
rows of a batch of specs are read in one statement; the decision is pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session

from broker.streams import TriggerSpec, task_label


@dataclass(frozen=True, slots=True)
class TriggerRow:
    """What PostgreSQL says now of the trigger an entry's spec names, and of the task instance
    the spec was published for."""

    classpath: str | None  # the trigger row's; None: no such row
    shared: bool  # the row has a share key: tasks of any try may join it
    waited_on: bool  # some task instance is deferred on this trigger
    task: str | None  # the spec's task instance's label (dag.run.task[map]); None: no such row
    try_number: int  # that task instance's try
    deferred_on_it: bool  # that task instance is deferred on this trigger


@dataclass(frozen=True, slots=True)
class SpecVerdict:
    """Whether to run an authenticated spec: ``refused`` names the check it failed (dead-letter
    it), ``stale`` says why nobody wants it any more (retire it quietly); neither: run it."""

    refused: str | None = None
    stale: str | None = None


RUN = SpecVerdict()


def spec_check(spec: TriggerSpec, row: TriggerRow) -> SpecVerdict:
    """Check a spec about to run against its trigger row in PostgreSQL: the classpath, the
    task instance and the try. A spec the token authenticated should always pass; one that does
    not was sealed by something other than a deferral of that task, so it runs nothing."""
    trigger_id = spec.trigger_id
    if row.classpath is None or not row.waited_on:
        return SpecVerdict(stale=f"trigger {trigger_id} is no longer waited on")
    if row.classpath != spec.classpath:
        return SpecVerdict(
            refused=f"classpath check: {spec.classpath!r:.200} is not trigger {trigger_id}'s"
            f" ({row.classpath!r:.200})"
        )
    if row.task is None:
        if row.shared:  # the task it was started for is gone; others still wait on it
            return RUN
        return SpecVerdict(refused=f"task check: no task instance {spec.task_instance_id}")
    if row.task != spec.task:
        return SpecVerdict(
            refused=f"task check: task instance {spec.task_instance_id} is {row.task!r:.250},"
            f" not {spec.task!r:.250}"
        )
    if spec.try_number > row.try_number:
        return SpecVerdict(
            refused=f"try check: task instance {spec.task_instance_id} is at try"
            f" {row.try_number}, not {spec.try_number}"
        )
    if row.shared:  # any try may have joined it since it was published
        return RUN
    if not row.deferred_on_it:
        return SpecVerdict(
            refused=f"task check: task instance {spec.task_instance_id} does not wait on"
            f" trigger {trigger_id}"
        )
    if spec.try_number not in (0, row.try_number):
        return SpecVerdict(
            refused=f"try check: task instance {spec.task_instance_id} deferred on trigger"
            f" {trigger_id} in try {row.try_number}, not {spec.try_number}"
        )
    return RUN


# Whether any task waits on the trigger is asked only where the spec's own task does not: a
# probe per such spec (the shared trigger case, or a stale entry). Asked of every spec, as an
# EXISTS, the planner hashed all the deferred task instances for each batch (100 ms at 100,000).
_ROWS_SQL = text(
    """
    SELECT t.classpath, t.share_key IS NOT NULL AS shared,
           s.deferred_on_it OR w.waited IS NOT NULL AS waited_on,
           s.dag_id, s.run_id, s.task_id, s.map_index, s.try_number, s.deferred_on_it
    FROM (
        SELECT s.n, s.trigger_id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index,
               ti.try_number,
               coalesce(ti.state = 'deferred' AND ti.trigger_id = s.trigger_id, false)
                   AS deferred_on_it
        FROM unnest(CAST(:triggers AS bigint[]), CAST(:tis AS bigint[]))
            WITH ORDINALITY AS s(trigger_id, ti_id, n)
        LEFT JOIN task_instance AS ti ON ti.id = s.ti_id
    ) AS s
    LEFT JOIN trigger AS t ON t.id = s.trigger_id
    LEFT JOIN LATERAL (
        SELECT true AS waited FROM task_instance
        WHERE NOT s.deferred_on_it AND trigger_id = s.trigger_id AND state = 'deferred'
        LIMIT 1
    ) AS w ON true
    ORDER BY s.n
    """
)


def trigger_rows(session: Session, specs: Sequence[TriggerSpec]) -> list[TriggerRow]:
    """The row facts of each spec, at the same positions."""
    if not specs:
        return []
    rows = session.execute(
        _ROWS_SQL,
        {
            "triggers": [s.trigger_id for s in specs],
            "tis": [s.task_instance_id for s in specs],
        },
    ).all()
    return [
        TriggerRow(
            classpath=r.classpath,
            shared=r.shared,
            waited_on=r.waited_on,
            task=None
            if r.dag_id is None
            else task_label(r.dag_id, r.run_id, r.task_id, r.map_index),
            try_number=r.try_number or 0,
            deferred_on_it=r.deferred_on_it,
        )
        for r in rows
    ]
