"""Exceptions that task code raises, or that the runtime raises into task code."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deferral.triggers.base import BaseTrigger


class DeferralException(Exception):
    """Base of every exception of this package."""


class TaskDeferred(DeferralException):
    """Raised (by ``BaseOperator.defer`` or by user code) to hand the wait to a trigger."""

    def __init__(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: dt.timedelta | None = None,
        cancel_on: BaseTrigger | None = None,
        cancel_state: str = "skipped",
    ) -> None:
        super().__init__(trigger, method_name, kwargs, timeout)
        self.trigger = trigger
        self.method_name = method_name
        self.kwargs = kwargs or {}
        self.timeout = timeout
        # A SignalTrigger whose signal, if it comes first, ends the task in ``cancel_state``.
        self.cancel_on = cancel_on
        self.cancel_state = cancel_state

    def __str__(self) -> str:
        return f"deferred to {type(self.trigger).__name__}, resuming at {self.method_name}()"


class TaskDeferralError(DeferralException):
    """The trigger the task waited on failed; the message carries its traceback."""


class TaskDeferralTimeout(DeferralException):
    """The deferral's timeout (or the task's execution_timeout) passed before the trigger fired."""


def deferral_failure(next_kwargs: dict[str, Any]) -> TaskDeferralTimeout | TaskDeferralError:
    """What a task resumed at ``__fail__`` raises: its deferral ended without an event, either
    timed out (``{"error": "timeout"}``) or because the trigger failed (message, traceback)."""
    if next_kwargs.get("error") == "timeout":
        return TaskDeferralTimeout("the deferral timed out before its trigger fired")
    detail = next_kwargs.get("message") or "trigger failed"
    trace = next_kwargs.get("traceback")
    return TaskDeferralError(f"{detail}\n{trace}" if trace else str(detail))


class SkipTask(DeferralException):
    """Ends the task in state skipped."""


class FailTask(DeferralException):
    """Fails the task without retrying it."""


class SensorTimeout(FailTask):
    """A sensor waited longer than its timeout."""


class MappingError(FailTask):
    """A mapped task's input cannot be mapped over (not a list or dict, missing, too long, a
    key that is no argument); the message names the task and the argument. Retrying would map
    over the same input, so the task fails without retry."""


class InactiveAssetInInletOrOutlet(FailTask):
    """The task names an inactive asset (one whose URI another asset, recorded first, holds)
    in its inlets or outlets: it fails before it runs, as Airflow fails it."""

    def __init__(self, assets: list[tuple[str, str]]) -> None:
        named = ", ".join(f"Asset(name={name!r}, uri={uri!r})" for name, uri in assets)
        super().__init__(
            f"Task has the following inactive assets in its inlets or outlets: {named}"
        )
        self.assets = assets


class TaskExecutionTimeout(DeferralException):
    """The task ran past its execution_timeout (counted from its try's first start)."""


class RescheduleTask(DeferralException):
    """Frees the worker slot and runs the task again at ``reschedule_date`` (same try): what a
    sensor in ``mode="reschedule"`` raises when its poke says "not yet"."""

    def __init__(self, reschedule_date: dt.datetime) -> None:
        super().__init__(reschedule_date)
        self.reschedule_date = reschedule_date


class ClusterPolicyViolation(DeferralException):
    """Raised by a cluster policy (``dag_policy``, ``task_policy``) to refuse a DAG: the DAG is
    not loaded and its file shows an import error with the message."""


class ClusterPolicySkipDag(DeferralException):
    """Raised by ``dag_policy`` to leave a DAG out silently: no DAG, no import error."""


class ClusterPolicyError(DeferralException):
    """A cluster policy failed in another way than refusing (it raised something else, or left a
    task with a value the runtime cannot use); shown as an import error like a violation."""


# Airflow's names, for DAG files whose imports were only renamed (``from deferral.exceptions
# import AirflowSkipException``): the same classes, so raising either spelling is the same.
AirflowException = DeferralException
AirflowSkipException = SkipTask
AirflowFailException = FailTask
AirflowSensorTimeout = SensorTimeout
AirflowRescheduleException = RescheduleTask
AirflowTaskTimeout = TaskExecutionTimeout
AirflowInactiveAssetInInletOrOutletException = InactiveAssetInInletOrOutlet


class TaskAwaitingInput(DeferralException):
    """Raised by ``HITLOperator.execute``: the task waits in state awaiting_input, holding no
    worker slot, pool slot or trigger, until someone responds or its response timeout passes.
    ``request`` is what it asks (a ``deferral.store.hitl.InputRequest``)."""

    def __init__(self, request: Any) -> None:
        super().__init__(request)
        self.request = request


class HITLTimeoutError(DeferralException):
    """No response came before the task's response timeout and it has no default options."""


class HITLRejectException(DeferralException):
    """An ApprovalOperator with ``fail_on_reject=True`` was rejected."""


class DagDefinitionError(ValueError):
    """A DAG or task is declared wrongly; the message names which. ``line``: the DAG file's line
    that declared it, when the error is found after the file ran (the DagBag shows it)."""

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class ActionError(Exception):
    """The action was refused; the message is one line naming the thing at fault.
    ``not_found``: because something named does not exist."""

    def __init__(self, message: str, *, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


class DagNotFound(LookupError):
    """No DAG of that id in the DAGs folder."""
