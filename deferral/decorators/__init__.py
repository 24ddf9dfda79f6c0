"""TaskFlow: ``@dag``, ``@task`` (and ``@task.sensor``, ``@task.branch``,
``@task.short_circuit``), ``@task_group``."""

from deferral.decorators.base import TaskDecorator
from deferral.decorators.dag import dag
from deferral.decorators.python import task
from deferral.decorators.task_group import task_group

__all__ = ["TaskDecorator", "dag", "task", "task_group"]
