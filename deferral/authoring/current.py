"""The context of the attempt this task process runs. A task process runs one attempt, and the
context it makes for it (``deferral.context.make_context``) is the one ``get_current_context``
gives task code; triggers built inside ``execute`` (a ``CallbackTrigger`` taking the task's own
token) read it here without importing the context's builders."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deferral.context import Context

_current_context: Context | None = None


def get_current_context() -> Context:
    """The running task's context, from anywhere in its code (Airflow's
    ``get_current_context``); raises RuntimeError outside a task."""
    if _current_context is None:
        raise RuntimeError("get_current_context(): no task is running in this process")
    return _current_context


def set_current_context(context: Context) -> Context:
    global _current_context
    _current_context = context
    return context
