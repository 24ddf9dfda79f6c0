"""``@asset`` (Airflow 3's ``airflow.sdk.asset``): a function that materialises one asset. It
becomes a DAG of its own (its id: the asset's name, the function's unless ``name`` is given)
with one task that runs the function and updates the asset.

The function's parameters are filled when it runs: ``self`` is the asset, ``context`` the
context, ``outlet_events`` the context's; any other parameter without a default names an
asset the task reads (one of its inlets, given as a reference to it)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from deferral.assets import Asset, AssetWatcher
from deferral.context import Context
from deferral.dag import DAG
from deferral.exceptions import DagDefinitionError
from deferral.operators.python import PythonOperator

_NOT_INLETS = ("self", "context", "outlet_events")


def _inlet_names(function: Callable[..., Any], where: str) -> list[str]:
    names: list[str] = []
    for name, param in inspect.signature(function).parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise DagDefinitionError(f"{where}: @asset takes no *args or **kwargs ({name!r})")
        if name not in _NOT_INLETS and param.default is inspect.Parameter.empty:
            names.append(name)
    return names


class AssetOperator(PythonOperator):
    """The task of an ``@asset`` function."""

    def __init__(self, *, asset: Asset, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.asset = asset

    def call_python_callable(self, context: Context) -> Any:
        values: Mapping[str, Any] = {
            "self": self.asset,
            "context": context,
            "outlet_events": context["outlet_events"],
        }
        kwargs: dict[str, Any] = {}
        for name, param in inspect.signature(self.python_callable).parameters.items():
            if param.default is not inspect.Parameter.empty:
                continue
            kwargs[name] = values[name] if name in values else Asset.ref(name=name)
        return self.python_callable(**kwargs)


def asset(
    *,
    schedule: Any,
    uri: str | None = None,
    name: str | None = None,
    group: str = "asset",
    extra: dict[str, Any] | None = None,
    watchers: list[AssetWatcher] | None = None,
    dag_id: str | None = None,
    **dag_kwargs: Any,
) -> Callable[[Callable[..., Any]], Asset]:
    """``@asset(schedule=..., uri=...)``: the decorated function becomes the asset (named as
    the function unless ``name`` is given) and the DAG that materialises it."""

    def decorate(function: Callable[..., Any]) -> Asset:
        if not callable(function):
            raise DagDefinitionError(f"@asset decorates a function, not {function!r}")
        made = Asset(
            name or function.__name__,
            uri,
            group=group,
            extra=extra,
            watchers=watchers or (),
        )
        where = f"@asset {made.name!r}"
        inlets = [Asset.ref(name=n) for n in _inlet_names(function, where)]
        with DAG(dag_id or made.name, schedule=schedule, catchup=False, **dag_kwargs):
            AssetOperator(
                task_id=function.__name__,
                python_callable=function,
                asset=made,
                inlets=inlets,
                outlets=[made],
            )
        return made

    return decorate
