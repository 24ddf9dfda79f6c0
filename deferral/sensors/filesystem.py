"""FileSensor (Airflow's ``airflow.sensors.filesystem``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deferral.context import Context
from deferral.exceptions import DagDefinitionError
from deferral.sensors.base import BaseSensorOperator
from deferral.triggers import FileTrigger
from deferral.triggers.file import find_file


class FileSensor(BaseSensorOperator):
    """Waits for ``filepath`` (a path or a glob pattern; ``recursive`` lets ``**`` span
    directories) to point at a file, or at a directory that holds one at any depth; it is
    templated."""

    template_fields: Sequence[str] = ("filepath",)

    def __init__(self, *, filepath: str, recursive: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(filepath, str) or not filepath:
            raise DagDefinitionError(f"task {self.task_id!r}: filepath must be a non-empty str")
        if self.deferrable and self.poke_interval <= 0:
            raise DagDefinitionError(
                f"task {self.task_id!r}: poke_interval must be greater than 0 when deferrable "
                "(the trigger polls at that interval)"
            )
        self.filepath = filepath
        self.recursive = recursive

    def poke(self, context: Context) -> bool:
        return find_file(self.filepath, self.recursive) is not None

    def execute(self, context: Context) -> Any:
        if self.deferrable:
            return self.poke_then_defer(
                context,
                lambda: FileTrigger(
                    self.filepath, poll_interval=self.poke_interval, recursive=self.recursive
                ),
            )
        return super().execute(context)
