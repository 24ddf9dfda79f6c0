"""Asset events: recorded when a task with outlets succeeds (in the success's own statement)
and when a watcher's event trigger fires (once per dedup key), each queued for the DAGs
scheduled on its asset."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from deferral.assets import ALIAS_KEY_PREFIX, MAX_EVENT_EXTRA_BYTES
from deferral.runtime.storable import storable, storable_text

# The schedule row of a DAG scheduled on an alias names it by this key (AssetAlias.key).
ALIAS = f"'{ALIAS_KEY_PREFIX}'"


def _queue_for_schedules(events: str, also: str = "") -> str:
    """The insert queueing each event of the CTE ``events`` for every DAG scheduled on its
    asset or on an alias resolved to it (``also``: one more schedule key the statement names,
    whose row it cannot see yet)."""
    on = f"s.asset_name IN (e.asset_name, {also})" if also else "s.asset_name = e.asset_name"
    return f"""INSERT INTO asset_dag_run_queue (target_dag_id, asset_event_id, asset_name)
        SELECT s.dag_id, e.id, s.asset_name
        FROM {events} AS e JOIN dag_schedule_asset AS s ON {on}
        UNION ALL
        SELECT s.dag_id, e.id, s.asset_name
        FROM {events} AS e
        JOIN asset_alias_asset AS r ON r.asset_name = e.asset_name
        JOIN dag_schedule_asset AS s ON s.asset_name = {ALIAS} || r.alias_name
        ON CONFLICT DO NOTHING"""


# CTEs for the success statement (``moved``: the task instances that succeeded, with their
# dag_id, run_id, task_id and map_index): an asset event per outlet of each, queued for every
# DAG scheduled on the asset. Read from ``moved``, not from task_instance again (a second index
# probe and heap fetch per success, for the most part of tasks with no outlets); an empty
# outlet table costs one probe.
OUTLET_EVENTS_OF_MOVED = f"""
    outlet_events AS (
        INSERT INTO asset_event (asset_name, source_dag_id, source_run_id, source_task_id,
                                 source_map_index)
        SELECT o.asset_name, moved.dag_id, moved.run_id, moved.task_id, moved.map_index
        FROM moved
        JOIN task_outlet_asset AS o ON o.dag_id = moved.dag_id AND o.task_id = moved.task_id
        ORDER BY moved.id, o.asset_name
        RETURNING id, asset_name
    ), outlet_queued AS (
        {_queue_for_schedules("outlet_events")}
    ),"""

_WATCHER_EVENT_SQL = text(
    f"""
    WITH event AS (
        INSERT INTO asset_event (asset_name, watcher, dedup_key, extra)
        VALUES (:asset_name, :watcher, :dedup_key, CAST(:extra AS jsonb))
        ON CONFLICT (asset_name, dedup_key) DO NOTHING
        RETURNING id, asset_name
    ), queued AS (
        {_queue_for_schedules("event")}
    )
    SELECT id FROM event
    """
)

# An event a task added through an alias (AliasEventAccessor.add), recorded with its success:
# the asset (if no parsed DAG named it yet), the alias resolving to it, the event, its link to
# the alias, and the queue rows of the DAGs scheduled on the asset or on an alias of it (this
# one's row is not visible to the statement that inserts it, so it is named directly).
_ALIAS_EVENT_SQL = text(
    f"""
    WITH ti AS (
        SELECT dag_id, run_id, task_id, map_index FROM task_instance WHERE id = :ti_id
    ), asset AS (
        INSERT INTO asset (name, uri, "group") VALUES (:asset_name, :uri, :group)
        ON CONFLICT (name) DO NOTHING
    ), resolved AS (
        INSERT INTO asset_alias_asset (alias_name, asset_name) VALUES (:alias, :asset_name)
        ON CONFLICT DO NOTHING
    ), event AS (
        INSERT INTO asset_event (asset_name, source_dag_id, source_run_id, source_task_id,
                                 source_map_index, extra)
        SELECT :asset_name, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, CAST(:extra AS jsonb)
        FROM ti
        RETURNING id, asset_name
    ), linked AS (
        INSERT INTO asset_alias_event (alias_name, asset_event_id) SELECT :alias, id FROM event
    ), queued AS (
        {_queue_for_schedules("event", also=ALIAS + " || :alias")}
    )
    SELECT id FROM event
    """
)


def record_alias_events(
    session: Session, task_instance_id: int, events: Sequence[Mapping[str, Any]]
) -> list[int]:
    """Record the events the task instance added through aliases (``alias``, the asset's
    ``name``, ``uri``, ``group``, and the ``extra``), in its success's transaction; returns
    their ids."""
    ids: list[int] = []
    for event in events:
        ids += session.scalars(
            _ALIAS_EVENT_SQL,
            {
                "ti_id": task_instance_id,
                "alias": event["alias"],
                "asset_name": event["name"],
                "uri": event["uri"],
                "group": event["group"],
                "extra": _extra_body(event["extra"]),
            },
        )
    return ids


def _extra_body(extra: Mapping[str, Any]) -> str:
    """``extra`` as stored: a NUL or lone surrogate escaped (``deferral.runtime.storable``),
    and one too big replaced by a note saying so."""
    body = json.dumps(storable(extra), default=lambda value: storable_text(str(value)))
    if len(body) > MAX_EVENT_EXTRA_BYTES:
        body = json.dumps({"error": f"extra of {len(body)} bytes is over {MAX_EVENT_EXTRA_BYTES}"})
    return body


# The latest event a task instance recorded for an asset (the one its success just wrote).
_ANNOTATE_SQL = text(
    """
    UPDATE asset_event SET extra = CAST(:extra AS jsonb)
    WHERE id = (
        SELECT max(e.id) FROM asset_event AS e JOIN task_instance AS ti
          ON e.source_dag_id = ti.dag_id AND e.source_run_id = ti.run_id
         AND e.source_task_id = ti.task_id AND e.source_map_index = ti.map_index
        WHERE ti.id = :ti_id AND e.asset_name = :asset_name
    )
    """
)


def annotate_outlet_events(
    session: Session, task_instance_id: int, extras: Mapping[str, Mapping[str, Any]]
) -> None:
    """Give the outlet events the task instance's success just recorded their ``extras`` (by
    asset name; in the success's transaction, so no reader sees the event without them)."""
    for asset_name, extra in sorted(extras.items()):
        session.execute(
            _ANNOTATE_SQL,
            {"ti_id": task_instance_id, "asset_name": asset_name, "extra": _extra_body(extra)},
        )


# The partitions of the latest event a task instance recorded for an asset (its success's): the
# event takes the first key, and a copy of it (same source and extra) is recorded and queued for
# each other key, in order.
_PARTITION_SQL = text(
    f"""
    WITH base AS (
        SELECT e.id, e.asset_name, e.source_dag_id, e.source_run_id, e.source_task_id,
               e.source_map_index, e.extra
        FROM asset_event AS e JOIN task_instance AS ti
          ON e.source_dag_id = ti.dag_id AND e.source_run_id = ti.run_id
         AND e.source_task_id = ti.task_id AND e.source_map_index = ti.map_index
        WHERE ti.id = :ti_id AND e.asset_name = :asset_name
        ORDER BY e.id DESC LIMIT 1
    ), keyed AS (
        UPDATE asset_event SET partition_key = :first_key WHERE id = (SELECT id FROM base)
    ), more AS (
        INSERT INTO asset_event (asset_name, source_dag_id, source_run_id, source_task_id,
                                 source_map_index, extra, partition_key)
        SELECT b.asset_name, b.source_dag_id, b.source_run_id, b.source_task_id,
               b.source_map_index, b.extra, k.key
        FROM base AS b CROSS JOIN unnest(CAST(:other_keys AS text[])) WITH ORDINALITY AS k(key, n)
        ORDER BY k.n
        RETURNING id, asset_name
    ), queued AS (
        {_queue_for_schedules("more")}
    )
    SELECT count(*) FROM more
    """
)


def partition_outlet_events(
    session: Session, task_instance_id: int, partitions: Mapping[str, Sequence[str]]
) -> None:
    """Give the outlet events the task instance's success just recorded their partition keys
    (by asset name, checked by the task: ``OutletEventAccessor.add_partitions``): one event per
    key, in the success's transaction (after their extras, which the copies carry)."""
    for asset_name, keys in sorted(partitions.items()):
        if keys:
            session.execute(
                _PARTITION_SQL,
                {
                    "ti_id": task_instance_id,
                    "asset_name": asset_name,
                    "first_key": keys[0],
                    "other_keys": list(keys[1:]),
                },
            )


def record_watcher_event(
    session: Session, asset_name: str, watcher: str, dedup_key: str, extra: Mapping[str, Any]
) -> int | None:
    """Record a watcher's event and queue it for the DAGs scheduled on the asset; None if an
    event with this key was recorded for the asset before (a redelivery). A NUL or lone
    surrogate in the key or the extra is stored escaped (``deferral.runtime.storable``); an extra
    too big
    is replaced by a note saying so (the event itself is kept)."""
    body = _extra_body(extra)
    return session.scalar(
        _WATCHER_EVENT_SQL,
        {
            "asset_name": asset_name,
            "watcher": watcher,
            "dedup_key": storable_text(dedup_key),
            "extra": body,
        },
    )


# Events of a watcher that wait for a run: queued for a DAG scheduled on the asset, or in a run
# that has not started yet (counted once, up to the bound).
_WAITING_SQL = text(
    """
    SELECT count(*) FROM (
        SELECT q.asset_event_id FROM asset_dag_run_queue AS q
        JOIN asset_event AS e ON e.id = q.asset_event_id
        WHERE q.asset_name = :asset_name AND e.watcher = :watcher
        UNION
        SELECT l.asset_event_id FROM dag_run AS r
        JOIN dag_run_asset_event AS l ON l.dag_run_id = r.id
        JOIN asset_event AS e ON e.id = l.asset_event_id
        WHERE r.state = 'queued' AND e.asset_name = :asset_name AND e.watcher = :watcher
        LIMIT :bound
    ) AS waiting
    """
)


def watcher_events_waiting(session: Session, asset_name: str, watcher: str, bound: int) -> int:
    """How many of the watcher's events wait for their runs, counted up to ``bound``."""
    return int(
        session.scalar(_WAITING_SQL, {"asset_name": asset_name, "watcher": watcher, "bound": bound})
        or 0
    )
