"""Built-in operators."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.dag import DagDefinitionError


class EmptyOperator(BaseOperator):
    """Does nothing; useful to shape a graph."""

    def execute(self, context: Context) -> None:
        return None


class PythonOperator(BaseOperator):
    """Calls ``python_callable(*op_args, **op_kwargs)``, adding the context entries its signature
    names (or all of them if it takes ``**kwargs``)."""

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] | None = None,
        op_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise DagDefinitionError(f"task {self.task_id!r}: python_callable is not callable")
        self.python_callable = python_callable
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})

    def execute(self, context: Context) -> Any:
        return self.python_callable(
            *self.op_args, **self.op_kwargs, **self._context_kwargs(context)
        )

    def _context_kwargs(self, context: Context) -> dict[str, Any]:
        try:
            parameters = inspect.signature(self.python_callable).parameters
        except (TypeError, ValueError):  # builtins such as print have no signature
            return {}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            wanted = set(context)
        else:
            wanted = set(parameters) & set(context)
        return {k: v for k, v in context.items() if k in wanted and k not in self.op_kwargs}
