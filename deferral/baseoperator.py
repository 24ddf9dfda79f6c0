"""BaseOperator: the unit of work, with ``defer()`` to hand a wait to a trigger."""

from __future__ import annotations

import copy
import datetime as dt
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from deferral.dag import DAG, DagDefinitionError, check_id
from deferral.exceptions import TaskDeferred
from deferral.trigger_rules import TriggerRule
from deferral.triggers.base import BaseTrigger

if TYPE_CHECKING:
    from deferral.context import Context


class _NotSet:
    def __repr__(self) -> str:
        return "NOTSET"


NOTSET: Any = _NotSet()

# Built-in defaults of the arguments that DAG(default_args=...) may set.
_DEFAULTS: dict[str, Any] = {
    "retries": 0,
    "retry_delay": dt.timedelta(minutes=5),
    "execution_timeout": None,
    "trigger_rule": TriggerRule.ALL_SUCCESS,
    "pool": "default_pool",
    "pool_slots": 1,
    "queue": "default",
    "priority_weight": 1,
}


class BaseOperator:
    """Subclass and implement ``execute(context)``; call ``self.defer(...)`` to wait cheaply."""

    # Attributes that tie the operator to its DAG; shared, not copied, by __deepcopy__.
    _shallow_attrs: ClassVar[frozenset[str]] = frozenset(
        {"dag", "upstream_task_ids", "downstream_task_ids"}
    )

    def __init__(
        self,
        *,
        task_id: str,
        dag: DAG | None = None,
        retries: int = NOTSET,
        retry_delay: dt.timedelta = NOTSET,
        execution_timeout: dt.timedelta | None = NOTSET,
        trigger_rule: str = NOTSET,
        pool: str = NOTSET,
        pool_slots: int = NOTSET,
        queue: str = NOTSET,
        priority_weight: int = NOTSET,
        **unknown: Any,
    ) -> None:
        self.task_id = check_id("task_id", task_id)
        if unknown:
            raise DagDefinitionError(
                f"task {task_id!r}: unknown argument(s) {', '.join(sorted(unknown))}"
            )
        self.dag = dag or DAG.current()
        given: dict[str, Any] = {
            "retries": retries,
            "retry_delay": retry_delay,
            "execution_timeout": execution_timeout,
            "trigger_rule": trigger_rule,
            "pool": pool,
            "pool_slots": pool_slots,
            "queue": queue,
            "priority_weight": priority_weight,
        }
        defaults = self.dag.default_args if self.dag else {}
        resolved: dict[str, Any] = {
            name: value if value is not NOTSET else defaults.get(name, _DEFAULTS[name])
            for name, value in given.items()
        }
        self.retries: int = resolved["retries"]
        self.retry_delay: dt.timedelta = resolved["retry_delay"]
        self.execution_timeout: dt.timedelta | None = resolved["execution_timeout"]
        self.pool: str = resolved["pool"]
        self.pool_slots: int = resolved["pool_slots"]
        self.queue: str = check_id("queue", resolved["queue"])
        self.priority_weight: int = resolved["priority_weight"]
        try:
            self.trigger_rule = TriggerRule(resolved["trigger_rule"])
        except ValueError:
            raise DagDefinitionError(
                f"task {task_id!r}: unknown trigger_rule {resolved['trigger_rule']!r}"
            ) from None
        if not isinstance(self.retries, int) or self.retries < 0:
            raise DagDefinitionError(f"task {task_id!r}: retries must be an int >= 0")
        self.upstream_task_ids: set[str] = set()
        self.downstream_task_ids: set[str] = set()
        if self.dag is not None:
            self.dag.add_task(self)

    def __repr__(self) -> str:
        return f"<Task({type(self).__name__}): {self.task_id}>"

    def __deepcopy__(self, memo: dict[int, Any]) -> BaseOperator:
        """A fresh copy for one run: state set on ``self`` during a run never leaks into
        another run or into the resumed instance."""
        cls = type(self)
        fresh = cls.__new__(cls)
        memo[id(self)] = fresh
        for name, value in self.__dict__.items():
            shared = name in self._shallow_attrs
            setattr(fresh, name, value if shared else copy.deepcopy(value, memo))
        return fresh

    # -- running -------------------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    def defer(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: dt.timedelta | None = None,
    ) -> NoReturn:
        """Free the worker slot and resume at ``method_name`` when ``trigger`` fires."""
        raise TaskDeferred(trigger=trigger, method_name=method_name, kwargs=kwargs, timeout=timeout)

    # -- dependencies --------------------------------------------------------------------------

    def _relate(self, others: BaseOperator | Sequence[BaseOperator], downstream: bool) -> None:
        for other in [others] if isinstance(others, BaseOperator) else others:
            if not isinstance(other, BaseOperator):
                raise DagDefinitionError(f"cannot set a dependency on {other!r}: not a task")
            if other.dag is not self.dag:
                raise DagDefinitionError(
                    f"tasks {self.task_id!r} and {other.task_id!r} are not in the same DAG"
                )
            up, down = (self, other) if downstream else (other, self)
            up.downstream_task_ids.add(down.task_id)
            down.upstream_task_ids.add(up.task_id)

    def set_downstream(self, others: BaseOperator | Sequence[BaseOperator]) -> None:
        self._relate(others, downstream=True)

    def set_upstream(self, others: BaseOperator | Sequence[BaseOperator]) -> None:
        self._relate(others, downstream=False)

    def __rshift__(self, other: Any) -> Any:
        self.set_downstream(other)
        return other

    def __lshift__(self, other: Any) -> Any:
        self.set_upstream(other)
        return other

    def __rrshift__(self, other: Any) -> BaseOperator:
        # [a, b] >> self
        self.set_upstream(other)
        return self

    def __rlshift__(self, other: Any) -> BaseOperator:
        # [a, b] << self
        self.set_downstream(other)
        return self


def chain(*tasks: BaseOperator | Sequence[BaseOperator]) -> None:
    """``chain(a, [b, c], d)``: a >> [b, c] >> d (lists of equal length pair up)."""
    for up, down in itertools.pairwise(tasks):
        if isinstance(up, BaseOperator):
            up.set_downstream(down)
        elif isinstance(down, BaseOperator):
            down.set_upstream(up)
        else:
            if len(up) != len(down):
                raise DagDefinitionError("chain() got adjacent lists of different lengths")
            for u, d in zip(up, down, strict=True):
                u.set_downstream(d)


def cross_downstream(
    from_tasks: Sequence[BaseOperator], to_tasks: BaseOperator | Sequence[BaseOperator]
) -> None:
    for task in from_tasks:
        task.set_downstream(to_tasks)
