"""Cluster policies, as Airflow's ``airflow_local_settings``: functions in a module named
``deferral_local_settings`` found on ``sys.path`` (the DAGs folder is on it in every process, so
``<DAGs folder>/deferral_local_settings.py`` works everywhere; so does any installed module).

- ``dag_policy(dag)`` runs on every DAG as it loads, then ``task_policy(task)`` on each of its
  tasks: in every process that loads DAG files (scheduler, worker, CLI), so what they change
  (``retries``, ``queue``, ``pool``...) holds everywhere. Raising ``ClusterPolicyViolation``
  refuses the DAG (an import error naming the policy and the message), raising
  ``ClusterPolicySkipDag`` leaves it out quietly; any other exception is a ClusterPolicyError,
  shown the same way.
- ``task_instance_mutation_hook(task_instance)`` runs where the scheduler creates a task
  instance, on a :class:`MutableTaskInstance` whose queue, pool, pool_slots, priority_weight and
  max_tries it may change.

The module is imported once per process: restart the services after changing it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deferral.dag import check_id
from deferral.exceptions import (
    ClusterPolicyError,
    ClusterPolicySkipDag,
    ClusterPolicyViolation,
    DagDefinitionError,
)
from deferral.trigger_rules import TriggerRule

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator
    from deferral.dag import DAG
    from deferral.store.transitions import NewTaskInstance

log = logging.getLogger("deferral.loading.policies")

LOCAL_SETTINGS_MODULE = "deferral_local_settings"
POLICY_NAMES = ("dag_policy", "task_policy", "task_instance_mutation_hook")


@dataclass
class MutableTaskInstance:
    """What ``task_instance_mutation_hook`` receives: a task instance about to be created.
    Change ``queue``, ``pool``, ``pool_slots``, ``priority_weight`` or ``max_tries``; the rest
    says which task instance it is."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    task: BaseOperator
    queue: str
    pool: str
    pool_slots: int
    priority_weight: int
    max_tries: int


@dataclass(frozen=True)
class ClusterPolicies:
    """The policies of a ``deferral_local_settings`` module (None where it defines none)."""

    module: str | None = None
    dag_policy: Callable[[DAG], Any] | None = None
    task_policy: Callable[[BaseOperator], Any] | None = None
    task_instance_mutation_hook: Callable[[MutableTaskInstance], Any] | None = None


NO_POLICIES = ClusterPolicies()


@functools.cache
def load_policies() -> ClusterPolicies:
    """The policies of ``deferral_local_settings`` on sys.path, or none if there is no such
    module; read once per process (after the DAGs folder went on sys.path). An error importing
    it propagates, and is not cached: policies that cannot be read must not be skipped."""
    try:
        module = importlib.import_module(LOCAL_SETTINGS_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == LOCAL_SETTINGS_MODULE:
            return NO_POLICIES
        raise
    found: dict[str, Any] = {}
    for name in POLICY_NAMES:
        policy = getattr(module, name, None)
        if policy is not None and not callable(policy):
            raise ClusterPolicyError(f"{LOCAL_SETTINGS_MODULE}.{name} is not callable")
        found[name] = policy
    return ClusterPolicies(module=LOCAL_SETTINGS_MODULE, **found)


def _run(policies: ClusterPolicies, name: str, target: Any, what: str) -> None:
    policy = getattr(policies, name)
    if policy is None:
        return
    qualified = f"{policies.module}.{name}"
    try:
        policy(target)
    except ClusterPolicySkipDag:
        raise
    except ClusterPolicyViolation as exc:
        raise ClusterPolicyViolation(f"{qualified} refused {what}: {exc}") from exc
    except Exception as exc:
        raise ClusterPolicyError(
            f"{qualified} raised {type(exc).__name__} on {what}: {exc}"
        ) from exc


def apply_dag_policies(dag: DAG, policies: ClusterPolicies) -> None:
    """``dag_policy`` on the DAG, then ``task_policy`` on each task, as Airflow does when it
    loads a DAG; then the values the policies left are checked. Raises ClusterPolicySkipDag,
    or ClusterPolicyViolation / ClusterPolicyError naming the policy and the DAG or task."""
    _run(policies, "dag_policy", dag, f"DAG {dag.dag_id!r}")
    for task in dag.tasks:
        where = f"task {task.task_id!r} of DAG {dag.dag_id!r}"
        _run(policies, "task_policy", task, where)
        try:
            task.trigger_rule = check_task_values(task, where)
        except DagDefinitionError as exc:
            raise ClusterPolicyError(f"after the cluster policies, {exc}") from None


def check_task_values(task: BaseOperator, where: str) -> TriggerRule:
    """The fields the runtime reads, as a policy may have left them; returns the trigger rule
    as a TriggerRule (a policy may set it as a string)."""
    _check_dispatch_values(
        where,
        tries_name="retries",
        tries=task.retries,
        pool=task.pool,
        pool_slots=task.pool_slots,
        queue=task.queue,
        priority_weight=task.priority_weight,
    )
    if not isinstance(task.retry_delay, dt.timedelta):
        raise DagDefinitionError(f"{where}: retry_delay must be a timedelta")
    if task.execution_timeout is not None and not isinstance(task.execution_timeout, dt.timedelta):
        raise DagDefinitionError(f"{where}: execution_timeout must be a timedelta or None")
    try:
        return TriggerRule(task.trigger_rule)
    except ValueError:
        raise DagDefinitionError(f"{where}: unknown trigger_rule {task.trigger_rule!r}") from None


def _is_int(value: object, least: int | None = None) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)
    )


def _check_dispatch_values(
    where: str,
    *,
    tries_name: str,
    tries: object,
    pool: object,
    pool_slots: object,
    queue: object,
    priority_weight: object,
) -> None:
    """What the scheduler stores and dispatches by; the tries are ``retries`` on a task,
    ``max_tries`` on a task instance."""
    if not _is_int(tries, 0):
        raise DagDefinitionError(f"{where}: {tries_name} must be an int >= 0, got {tries!r}")
    if not isinstance(pool, str) or not pool:
        raise DagDefinitionError(f"{where}: pool must be a non-empty str, got {pool!r}")
    if not _is_int(pool_slots, 1):
        raise DagDefinitionError(f"{where}: pool_slots must be an int >= 1, got {pool_slots!r}")
    try:
        check_id("queue", queue)
    except DagDefinitionError as exc:
        raise DagDefinitionError(f"{where}: {exc}") from None
    if not _is_int(priority_weight):
        raise DagDefinitionError(
            f"{where}: priority_weight must be an int, got {priority_weight!r}"
        )


def mutate_task_instance(
    new: NewTaskInstance,
    *,
    dag_id: str,
    run_id: str,
    task: BaseOperator,
    hook: Callable[[MutableTaskInstance], Any],
) -> NewTaskInstance:
    """``new`` as ``hook`` (a task_instance_mutation_hook) changes it. Raises
    ClusterPolicyError naming the hook and the task instance if the hook raises or leaves a
    value the runtime cannot use."""
    where = f"task instance {dag_id}.{run_id}.{new.task_id}"
    mutable = MutableTaskInstance(
        dag_id=dag_id,
        run_id=run_id,
        task_id=new.task_id,
        map_index=new.map_index,
        try_number=0,
        task=task,
        queue=new.queue,
        pool=new.pool,
        pool_slots=new.pool_slots,
        priority_weight=new.priority_weight,
        max_tries=new.max_tries,
    )
    name = f"{LOCAL_SETTINGS_MODULE}.task_instance_mutation_hook"
    try:
        hook(mutable)
    except Exception as exc:
        raise ClusterPolicyError(f"{name} raised {type(exc).__name__} on {where}: {exc}") from exc
    try:
        _check_dispatch_values(
            where,
            tries_name="max_tries",
            tries=mutable.max_tries,
            pool=mutable.pool,
            pool_slots=mutable.pool_slots,
            queue=mutable.queue,
            priority_weight=mutable.priority_weight,
        )
    except DagDefinitionError as exc:
        raise ClusterPolicyError(f"after {name}, {exc}") from None
    return dataclasses.replace(
        new,
        queue=mutable.queue,
        pool=mutable.pool,
        pool_slots=mutable.pool_slots,
        priority_weight=mutable.priority_weight,
        max_tries=mutable.max_tries,
    )


def apply_task_instance_mutation_hook(
    new: NewTaskInstance, *, dag_id: str, run_id: str, task: BaseOperator
) -> NewTaskInstance:
    """Where the scheduler creates a task instance: ``new`` as the local settings'
    task_instance_mutation_hook changes it. A hook that fails is logged, naming itself and the
    task instance, and the task instance keeps the values its task gave it: one bad hook call
    never stops the scheduler nor harms other tasks."""
    try:
        hook = load_policies().task_instance_mutation_hook
        if hook is None:
            return new
        return mutate_task_instance(new, dag_id=dag_id, run_id=run_id, task=task, hook=hook)
    except Exception as exc:
        log.error("cluster policy: %s; the task instance keeps its task's values", exc)
        return new
