"""A trigger defined inside the archive: its classpath, example_packaged_lib.triggers.
CountdownTrigger, imports in the worker and in the triggerer alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral.triggers import BaseTrigger, TriggerEvent
from deferral.triggers.base import classpath_of


class CountdownTrigger(BaseTrigger):
    def __init__(self, seconds: int) -> None:
        super().__init__()
        self.seconds = seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(CountdownTrigger), {"seconds": self.seconds}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await anyio.sleep(self.seconds)
        yield TriggerEvent(f"counted down {self.seconds}s")
