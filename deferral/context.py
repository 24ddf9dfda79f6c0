"""The context a task's ``execute`` and resume methods receive."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator
    from deferral.dag import DAG


class XComBackend(Protocol):
    def push(self, task_instance_id: int, key: str, value: Any) -> None: ...

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int) -> Any: ...


@dataclass(frozen=True)
class DagRunInfo:
    dag_id: str
    run_id: str
    logical_date: dt.datetime
    conf: dict[str, Any] = field(default_factory=dict)


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

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms.push(self.id, key, value)

    def xcom_pull(
        self,
        task_ids: str | list[str] | None = None,
        key: str = "return_value",
        map_index: int = -1,
    ) -> Any:
        """One task id gives its value (None if absent); a list gives a list of values."""
        if task_ids is None:
            task_ids = self.task_id
        if isinstance(task_ids, str):
            return self.xcoms.pull(self.dag_id, self.run_id, task_ids, key, map_index)
        return [self.xcoms.pull(self.dag_id, self.run_id, t, key, map_index) for t in task_ids]


class Context(TypedDict):
    ti: RuntimeTaskInstance
    task: BaseOperator
    dag: DAG
    dag_run: DagRunInfo
    run_id: str
    logical_date: dt.datetime
    params: dict[str, Any]
    try_number: int
