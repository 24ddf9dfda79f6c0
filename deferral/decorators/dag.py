"""``@dag``: a function whose call builds a DAG from the tasks it creates."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from deferral.dag import DAG
from deferral.exceptions import DagDefinitionError


def dag(dag_id: Any = None, **dag_kwargs: Any) -> Any:
    """``@dag`` or ``@dag(dag_id=..., schedule=..., default_args=...)``: the decorated function
    becomes a DAG factory. Calling it (``my_dag()`` at module level, as in Airflow) builds the
    DAG, which the DagBag finds without it being assigned. The id is the function's name unless
    ``dag_id`` is given; its docstring is the DAG's ``doc_md`` unless one is given; each of its
    parameters becomes a DAG param (default: the parameter's default), and inside the function
    it is a reference to the run's param, resolved when a task runs."""
    if callable(dag_id):
        return dag()(dag_id)
    if dag_id is not None and not isinstance(dag_id, str):
        raise DagDefinitionError(f"@dag takes a dag_id and keyword arguments, not {dag_id!r}")

    def decorate(function: Callable[..., Any]) -> Callable[..., DAG]:
        if not callable(function):
            raise DagDefinitionError(f"@dag decorates a function, not {function!r}")
        name = dag_id or function.__name__

        @functools.wraps(function)
        def factory(*args: Any, **kwargs: Any) -> DAG:
            try:
                bound = inspect.signature(function).bind(*args, **kwargs)
            except TypeError as exc:
                raise DagDefinitionError(f"DAG {name!r}: {exc}") from None
            bound.apply_defaults()
            with DAG(name, **dag_kwargs) as new_dag:
                if function.__doc__ and not new_dag.doc_md:
                    new_dag.doc_md = inspect.cleandoc(function.__doc__)
                params = {key: new_dag.param(key, value) for key, value in bound.arguments.items()}
                function(**params)
            return new_dag

        return factory

    return decorate
