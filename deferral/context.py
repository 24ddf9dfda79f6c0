"""The context a task's ``execute`` and resume methods receive."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

from deferral import macros
from deferral.assets import OutletEventAccessors
from deferral.authoring.current import get_current_context as get_current_context
from deferral.authoring.current import set_current_context
from deferral.connections import ConnectionAccessor
from deferral.store.seam import (
    AssetStateStores,
    CallbackHandle,
    LazyInletEvents,
    LazyTriggeringEvents,
    TaskStateStore,
)
from deferral.variables import VariableAccessor

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator
    from deferral.dag import DAG
    from deferral.store.seam import DagRun


class XComBackend(Protocol):
    def push(self, task_instance_id: int, key: str, value: Any) -> None: ...

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        """The value of one map index (-1: an unmapped task); ``None``: the task's value if it
        is not mapped, else the list of its map indexes' values in map-index order."""
        ...


@dataclass(frozen=True)
class DagRunInfo:
    """``context["dag_run"]``."""

    dag_id: str
    run_id: str
    logical_date: dt.datetime
    conf: dict[str, Any] = field(default_factory=dict)
    data_interval_start: dt.datetime | None = None
    data_interval_end: dt.datetime | None = None
    run_type: str = "manual"
    # Airflow 3.2+'s partitioned runs: a CronPartitionTimetable's run has its key (and the
    # point it names), a PartitionedAssetTimetable's the key its events mapped to; other runs
    # have none.
    partition_key: str | None = None
    partition_date: dt.datetime | None = None

    @classmethod
    def of(cls, run: DagRun) -> DagRunInfo:
        """What a task's or a DAG callback's context says of the run ``run`` (its row)."""
        return cls(
            dag_id=run.dag_id,
            run_id=run.run_id,
            logical_date=run.logical_date,
            conf=dict(run.conf or {}),
            data_interval_start=run.data_interval_start,
            data_interval_end=run.data_interval_end,
            run_type=run.run_type,
            partition_key=run.partition_key,
        )

    @property
    def execution_date(self) -> dt.datetime:
        """Airflow's older name of the logical date."""
        return self.logical_date

    @property
    def external_trigger(self) -> bool:
        return self.run_type == "manual"


@dataclass
class RuntimeTaskInstance:
    """``context["ti"]``: the running task instance, with XCom access."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    xcoms: XComBackend
    # When this try first started; it runs across deferrals and reschedules.
    first_started_at: dt.datetime
    # Tasks of the run to skip if this try succeeds (what a branch or short circuit chose
    # against); the worker skips them in the transaction that records the success.
    skip_task_ids: set[str] = field(default_factory=set)

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms.push(self.id, key, value)

    def xcom_pull(
        self,
        task_ids: str | list[str] | None = None,
        key: str = "return_value",
        map_indexes: int | Iterable[int] | None = None,
    ) -> Any:
        """One task id gives its value (None if absent); a list gives a list of values. As in
        Airflow, a mapped task's value is the list of the values its map indexes pushed, in
        map-index order (``map_indexes`` picks one index, or a list of them)."""
        if task_ids is None:
            task_ids = self.task_id
        if isinstance(task_ids, str):
            return self._pull(task_ids, key, map_indexes)
        return [self._pull(t, key, map_indexes) for t in task_ids]

    def _pull(self, task_id: str, key: str, map_indexes: int | Iterable[int] | None) -> Any:
        if map_indexes is None or isinstance(map_indexes, int):
            return self.xcoms.pull(self.dag_id, self.run_id, task_id, key, map_indexes)
        return [self.xcoms.pull(self.dag_id, self.run_id, task_id, key, i) for i in map_indexes]


class Context(TypedDict):
    """What ``execute`` receives and templates read: Airflow's context keys."""

    ti: RuntimeTaskInstance
    task_instance: RuntimeTaskInstance
    task: BaseOperator
    dag: DAG
    dag_run: DagRunInfo
    run_id: str
    logical_date: dt.datetime
    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    ds: str
    ds_nodash: str
    ts: str
    ts_nodash: str
    ts_nodash_with_tz: str
    task_instance_key_str: str
    params: dict[str, Any]
    try_number: int
    var: dict[str, VariableAccessor]
    conn: ConnectionAccessor
    macros: ModuleType
    # This attempt's callback token and URL (CallbackTrigger), made on first use.
    callback: CallbackHandle
    triggering_asset_events: Mapping[Any, Any]
    outlet_events: OutletEventAccessors
    inlet_events: Mapping[Any, Any]
    partition_key: str | None
    partition_date: dt.datetime | None
    # Airflow 3.3's state stores: the task instance's keys across its tries, its assets' keys.
    task_state_store: TaskStateStore
    asset_state_store: AssetStateStores
    # Deprecated in Airflow 2 but in many DAGs: the logical date, the run after, the day around.
    execution_date: dt.datetime
    next_execution_date: dt.datetime
    next_ds: str
    next_ds_nodash: str
    yesterday_ds: str
    yesterday_ds_nodash: str
    tomorrow_ds: str
    tomorrow_ds_nodash: str
    # Only in the context of on_failure_callback and on_retry_callback: what the task raised.
    exception: NotRequired[BaseException]


def with_data_interval(dag_run: DagRunInfo) -> DagRunInfo:
    """A run without a recorded data interval (a manual run) gets the interval of its logical
    date: start = end = logical date."""
    if dag_run.data_interval_start is not None and dag_run.data_interval_end is not None:
        return dag_run
    return dataclasses.replace(
        dag_run,
        data_interval_start=dag_run.data_interval_start or dag_run.logical_date,
        data_interval_end=dag_run.data_interval_end or dag_run.logical_date,
    )


def with_partition(dag_run: DagRunInfo, timetable: object) -> DagRunInfo:
    """A run of a DAG scheduled by partitions of the clock (``CronPartitionTimetable``) gets
    the key of its logical date."""
    key_of = getattr(timetable, "partition_key", None)
    if dag_run.partition_key is not None or not callable(key_of):
        return dag_run
    return dataclasses.replace(
        dag_run, partition_key=key_of(dag_run.logical_date), partition_date=dag_run.logical_date
    )


def make_context(task: BaseOperator, dag_run: DagRunInfo, ti: RuntimeTaskInstance) -> Context:
    """The context of one attempt of ``task``; dates are in UTC, as in Airflow. It becomes the
    process's current context (``get_current_context``)."""
    return set_current_context(build_context(task, dag_run, ti))


# Stateless: one of each serves every context of the process.
_VARIABLES_AS_TEXT = VariableAccessor(deserialize_json=False)
_VARIABLES_AS_JSON = VariableAccessor(deserialize_json=True)
_CONNECTIONS = ConnectionAccessor()


def build_context(task: BaseOperator, dag_run: DagRunInfo, ti: RuntimeTaskInstance) -> Context:
    """The context of one attempt of ``task``, without making it the process's current one
    (outside a task process: a clear rendering an ExternalTaskMarker's date)."""
    assert task.dag is not None
    run = with_partition(with_data_interval(dag_run), task.dag.timetable)
    assert run.data_interval_start is not None and run.data_interval_end is not None
    dates = _dates(run.logical_date, run.data_interval_end, run.external_trigger)
    return {
        **dates,  # type: ignore[typeddict-item]
        "ti": ti,
        "task_instance": ti,
        "task": task,
        "dag": task.dag,
        "dag_run": run,
        "run_id": run.run_id,
        "data_interval_start": run.data_interval_start.astimezone(dt.UTC),
        "task_instance_key_str": f"{task.dag.dag_id}__{task.task_id}__{dates['ds_nodash']}",
        # DAG params, then the task's, then the run's conf (Airflow's default precedence).
        "params": {**task.params, **run.conf},
        "try_number": ti.try_number,
        "var": {"value": _VARIABLES_AS_TEXT, "json": _VARIABLES_AS_JSON},
        "conn": _CONNECTIONS,
        "macros": macros,
        "callback": CallbackHandle(ti.id, ti.try_number),
        # Read on first use: only asset-triggered runs have any.
        "triggering_asset_events": LazyTriggeringEvents(run.dag_id, run.run_id),
        "outlet_events": OutletEventAccessors(getattr(task, "outlets", None) or ()),
        "inlet_events": LazyInletEvents(getattr(task, "inlets", None) or ()),
        "partition_key": run.partition_key,
        "partition_date": run.partition_date,
        "task_state_store": TaskStateStore(ti.id),
        "asset_state_store": AssetStateStores(
            [*(getattr(task, "inlets", None) or ()), *(getattr(task, "outlets", None) or ())]
        ),
    }


def run_context(dag_run: DagRunInfo) -> dict[str, Any]:
    """What a template may use that the run alone gives (its dates, ``dag_run``, ``run_id``,
    its conf as ``params``, ``macros``): a clear renders an ExternalTaskMarker's date with it
    from the DAG's document, without the task's objects."""
    run = with_data_interval(dag_run)
    assert run.data_interval_start is not None and run.data_interval_end is not None
    return {
        **_dates(run.logical_date, run.data_interval_end, run.external_trigger),
        "dag_run": run,
        "run_id": run.run_id,
        "data_interval_start": run.data_interval_start.astimezone(dt.UTC),
        "params": dict(run.conf),
        "macros": macros,
    }


@lru_cache(maxsize=64)
def _dates(
    logical_date: dt.datetime, data_interval_end: dt.datetime, manual: bool
) -> dict[str, dt.datetime | str]:
    """The context's values derived from the run's dates, in UTC as in Airflow (the tasks of a
    run share them: formatting them per attempt was a tenth of a task process's CPU)."""
    logical = logical_date.astimezone(dt.UTC)
    # The run after a scheduled one starts where its interval ends; a manual run has none.
    following = logical if manual else data_interval_end.astimezone(dt.UTC)
    ds, ts = logical.strftime("%Y-%m-%d"), logical.isoformat()
    yesterday = (logical - dt.timedelta(days=1)).strftime("%Y-%m-%d")
    tomorrow = (logical + dt.timedelta(days=1)).strftime("%Y-%m-%d")
    return {
        "logical_date": logical,
        "data_interval_end": data_interval_end.astimezone(dt.UTC),
        "ds": ds,
        "ds_nodash": ds.replace("-", ""),
        "ts": ts,
        "ts_nodash": logical.strftime("%Y%m%dT%H%M%S"),
        "ts_nodash_with_tz": ts.replace("-", "").replace(":", ""),
        "execution_date": logical,
        "next_execution_date": following,
        "next_ds": following.strftime("%Y-%m-%d"),
        "next_ds_nodash": following.strftime("%Y%m%d"),
        "yesterday_ds": yesterday,
        "yesterday_ds_nodash": yesterday.replace("-", ""),
        "tomorrow_ds": tomorrow,
        "tomorrow_ds_nodash": tomorrow.replace("-", ""),
    }
