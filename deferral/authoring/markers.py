"""What an ExternalTaskMarker names, as a DAG object and a DAG's parsed document both give it to
a clear (``deferral.store.actions.change_tasks``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoredMarker:
    """The task a clear of an ExternalTaskMarker also clears (``external_task_id`` of
    ``external_dag_id``), in the run at its ``logical_date`` (a template, rendered at the
    clear), at most ``recursion_depth`` DAGs deep."""

    external_dag_id: str
    external_task_id: str
    logical_date: str
    recursion_depth: int


def marker_of(task: object) -> StoredMarker | None:
    """What ``task`` names if it is an ExternalTaskMarker (its ``marker_target``), else None."""
    target = getattr(task, "marker_target", None)
    return target if isinstance(target, StoredMarker) else None
