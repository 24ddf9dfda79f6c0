"""deferral: a workflow runtime whose tasks can defer their waits to async triggers.

The public names below are imported on first use (PEP 562): ``import deferral`` alone, as every
service and command does to reach ``deferral.runtime`` or ``deferral.store``, loads none of
the DAG machinery, so ``deferral --version`` starts at once. ``from deferral import DAG`` and
``deferral.DAG`` work as eager imports would.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator, chain, cross_downstream
    from deferral.connections import Connection
    from deferral.context import Context
    from deferral.dag import DAG
    from deferral.decorators.dag import dag
    from deferral.decorators.python import task
    from deferral.decorators.task_group import task_group
    from deferral.utils.task_group import TaskGroup
    from deferral.variables import Variable
    from deferral.xcom_arg import XComArg

# Each public name -> the module that defines it.
_PUBLIC = {
    "DAG": "deferral.dag",
    "BaseOperator": "deferral.baseoperator",
    "Connection": "deferral.connections",
    "Context": "deferral.context",
    "TaskGroup": "deferral.utils.task_group",
    "Variable": "deferral.variables",
    "XComArg": "deferral.xcom_arg",
    "chain": "deferral.baseoperator",
    "cross_downstream": "deferral.baseoperator",
    "dag": "deferral.decorators",
    "task": "deferral.decorators",
    "task_group": "deferral.decorators",
}

__all__ = [
    "DAG",
    "BaseOperator",
    "Connection",
    "Context",
    "TaskGroup",
    "Variable",
    "XComArg",
    "chain",
    "cross_downstream",
    "dag",
    "task",
    "task_group",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'deferral' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # found as a plain attribute from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


class _Package(types.ModuleType):
    """``deferral.dag`` is the ``@dag`` decorator, as ``from deferral import dag`` gives it; the
    import system binds every submodule on its package once imported, and would otherwise make
    it the module ``deferral.dag`` (where ``DAG`` is defined) as soon as anything imports it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "dag" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
