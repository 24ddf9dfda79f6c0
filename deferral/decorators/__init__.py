"""TaskFlow: ``@dag``, ``@task`` (and ``@task.sensor``, ``@task.branch``,
``@task.short_circuit``), ``@task_group``, ``@setup`` and ``@teardown``."""

from deferral.decorators.base import TaskDecorator
from deferral.decorators.dag import dag
from deferral.decorators.python import task
from deferral.decorators.setup_teardown import setup, teardown
from deferral.decorators.task_group import task_group

__all__ = ["TaskDecorator", "dag", "setup", "task", "task_group", "teardown"]
