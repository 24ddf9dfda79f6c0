"""What deferral does with each argument Airflow 2.10 accepts on ``DAG``, ``BaseOperator`` and
the shipped operators that deferral does not take as its own: the one table the README's
"Coming from Airflow" follows.

- ``KEPT``: descriptive (shown, not acted on): accepted and kept as an attribute.
- ``INERT``: Airflow acts on it, deferral does not (yet); accepted only with the value under
  which Airflow does nothing either (e.g. ``sla=None``), and kept; any other value
  is refused when the DAG loads, naming the argument and saying why.
- ``TASK_DEPRECATED`` / ``DAG_DEPRECATED``: honoured with a DeprecationWarning (``sla`` and
  ``sla_miss_callback`` map to a deadline alert, ``deferral.deadline``).
- ``EMAIL_ARGUMENTS``: honoured (email alerts, ``deferral.utils.email``): checked, and kept as
  attributes for the task process that composes the alert.

An argument in none of these is unknown, and refused as such.
"""

from __future__ import annotations

import datetime as dt
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deferral.assets import check_outlets
from deferral.priority_strategy import load_weight_rule, weight_rule_error
from deferral.utils.email import check_email_argument


@dataclass(frozen=True)
class Inert:
    """An argument accepted only while it leaves Airflow's behaviour alone."""

    does_nothing: Callable[[Any], bool]
    reason: str


def _none(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is False or value is None


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, Iterable) and not list(value))


def _equals(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


_NOT_YET = "not implemented by deferral yet"

# Task arguments (BaseOperator and the shipped operators) kept as attributes, never acted on.
TASK_KEPT = frozenset(
    {
        "owner",  # shown; no access control by owner
        "task_display_name",
        "logger_name",
        "allow_nested_operators",  # Airflow only warns
        "map_index_template",  # a mapped task's label in the UI
        "show_return_value_in_logs",
        "max_retry_delay",  # acts only with retry_exponential_backoff, which is refused
    }
)

TASK_INERT: Mapping[str, Inert] = {
    "pre_execute": Inert(_none, f"pre_execute hooks are {_NOT_YET}"),
    "retry_exponential_backoff": Inert(_false, f"exponential retry delays are {_NOT_YET}"),
    "resources": Inert(_none, "deferral's workers do not reserve resources per task"),
    "run_as_user": Inert(_none, "tasks run as the worker's user"),
    "task_concurrency": Inert(_none, f"per-task concurrency limits are {_NOT_YET}"),
    "max_active_tis_per_dag": Inert(_none, f"per-task concurrency limits are {_NOT_YET}"),
    "max_active_tis_per_dagrun": Inert(_none, f"per-task concurrency limits are {_NOT_YET}"),
    "executor": Inert(_none, "deferral has one executor: its workers"),
    "executor_config": Inert(_empty, "deferral has one executor: its workers"),
    "start_from_trigger": Inert(
        _false,
        "set start_from_trigger = True and start_trigger_args on the operator (class or "
        "__init__), as Airflow 2.10 does; not a BaseOperator argument",
    ),
    "end_from_trigger": Inert(
        _false,
        "a trigger ends its task by yielding TaskSuccessEvent / TaskFailedEvent / "
        "TaskSkippedEvent (DateTimeTrigger(end_from_trigger=True)); not a BaseOperator argument",
    ),
    "trigger_kwargs": Inert(_empty, f"trigger_kwargs is {_NOT_YET}"),
    "fs_conn_id": Inert(
        _equals("fs_default"), "FileSensor paths are absolute; no filesystem connections"
    ),
}

# A task's own start_date / end_date: honoured when they are the DAG's (as default_args often
# make them); other values are refused in BaseOperator, which knows the DAG.
TASK_DATES = ("start_date", "end_date")
TASK_DATES_REASON = f"a task's own start_date / end_date, other than its DAG's, is {_NOT_YET}"

DAG_INERT: Mapping[str, Inert] = {
    "access_control": Inert(_none, "deferral's web UI has no per-DAG roles"),
    "fail_stop": Inert(_false, f"fail_stop is {_NOT_YET}"),
    "max_consecutive_failed_dag_runs": Inert(
        _equals(0, None), f"pausing after failed runs is {_NOT_YET}"
    ),
}

# Honoured but deprecated: accepted with a DeprecationWarning saying what they map to.
SLA_DEPRECATION = (
    "SLAs are deprecated (Airflow 3 replaces them with deadline alerts): mapped to"
    " DAG(deadline=DeadlineAlert(DeadlineReference.DAGRUN_QUEUED_AT, the smallest task sla,"
    " the DAG's sla_miss_callback))"
)
TASK_DEPRECATED: Mapping[str, str] = {"sla": SLA_DEPRECATION}
DAG_DEPRECATED: Mapping[str, str] = {"sla_miss_callback": SLA_DEPRECATION}

# ``email``, ``email_on_failure``, ``email_on_retry``: honoured (``deferral.utils.email``): an
# alert goes to the addresses when a try fails into a retry or for good, unless its flag is
# False (both default to True, as in Airflow). Checked here, kept as attributes.
EMAIL_ARGUMENTS = ("email", "email_on_failure", "email_on_retry")

# Every Airflow task argument BaseOperator accepts besides its own: default_args apply to them
# as to its own (Airflow's BaseOperator takes them all), so they are checked on every task.
# Honoured: the assets a task updates when it succeeds, and those whose events it reads
# (``context["inlet_events"]``) (``deferral.assets``).
ASSET_ARGUMENTS = frozenset({"outlets", "inlets"})
# Honoured: "absolute" or a PriorityWeightStrategy (``deferral.priority_strategy``).
WEIGHT_RULE = "weight_rule"
TASK_ARGUMENTS = frozenset(
    {
        *TASK_KEPT,
        *TASK_INERT,
        *TASK_DATES,
        *EMAIL_ARGUMENTS,
        *ASSET_ARGUMENTS,
        *TASK_DEPRECATED,
        WEIGHT_RULE,
    }
)


class RefusedArgument(ValueError):
    """An argument Airflow acts on that deferral does not implement, given a value that acts."""


def refusal(name: str, value: Any, reason: str) -> str:
    return f"{name}={value!r} is not supported by deferral: {reason}"


def email_argument_error(name: str, value: Any) -> str | None:
    """Why the value of one of EMAIL_ARGUMENTS is malformed, or None."""
    if name == "email":
        return check_email_argument(value)
    if value is not None and not isinstance(value, bool):
        return f"{name} must be True or False, got {value!r}"
    return None


def check_task_arguments(
    where: str, given: Mapping[str, Any], dag_dates: Mapping[str, Any]
) -> dict[str, Any]:
    """The Airflow arguments among ``given`` (names BaseOperator does not take) to keep as
    attributes; raises RefusedArgument for one Airflow acts on, or an unknown one, naming it."""
    kept: dict[str, Any] = {}
    unknown = []
    for name in sorted(given):
        value = given[name]
        if name in TASK_KEPT:
            kept[name] = value
        elif name in EMAIL_ARGUMENTS:
            error = email_argument_error(name, value)
            if error:
                raise RefusedArgument(f"{where}: {error}")
            kept[name] = value
        elif name in ASSET_ARGUMENTS:
            kept[name] = check_outlets(where, value, name)
        elif name == WEIGHT_RULE:
            error = weight_rule_error(value)
            if error:
                raise RefusedArgument(f"{where}: {refusal(name, value, error)}")
            kept[name] = load_weight_rule(value)
        elif name in TASK_INERT:
            rule = TASK_INERT[name]
            if not rule.does_nothing(value):
                raise RefusedArgument(f"{where}: {refusal(name, value, rule.reason)}")
            kept[name] = value
        elif name in TASK_DEPRECATED:
            if value is not None:
                if not isinstance(value, dt.timedelta):
                    raise RefusedArgument(f"{where}: {name} must be a timedelta, not {value!r}")
                warnings.warn(f"{where}: {name}: {TASK_DEPRECATED[name]}", DeprecationWarning, 4)
            kept[name] = value
        elif name in TASK_DATES:
            if value is not None and value != dag_dates.get(name):
                raise RefusedArgument(f"{where}: {refusal(name, value, TASK_DATES_REASON)}")
            kept[name] = value
        else:
            unknown.append(name)
    if unknown:
        raise RefusedArgument(f"{where}: unknown argument(s) {', '.join(unknown)}")
    return kept


def check_dag_arguments(where: str, given: Mapping[str, Any]) -> None:
    """Refuse, naming it, a DAG argument Airflow acts on that deferral does not implement (given
    a value that acts), or an unknown one."""
    for name in sorted(given):
        rule = DAG_INERT.get(name)
        if rule is None:
            raise RefusedArgument(f"{where}: unknown argument {name}")
        if not rule.does_nothing(given[name]):
            raise RefusedArgument(f"{where}: {refusal(name, given[name], rule.reason)}")


def refused_default_args(default_args: Mapping[str, Any], taken: set[str]) -> str | None:
    """The first ``default_args`` key (as ``name=value: reason``) that no task of the DAG takes
    and that Airflow would act on while deferral does not; None if there is none. Keys Airflow
    ignores too (no operator takes them, none acts on them) are left alone, as Airflow does."""
    for name in sorted(set(default_args) - taken):
        value = default_args[name]
        rule = TASK_INERT.get(name)
        if rule is not None and not rule.does_nothing(value):
            return refusal(name, value, rule.reason)
    return None
