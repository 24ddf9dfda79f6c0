"""A trigger class defined in a DAGs-folder module runs in the triggerer once its module is
allowed by DEFERRAL_TRIGGER_MODULES, and its payload reaches the resume method."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from deferral.xcom import DatabaseXComs
from tests.e2e.conftest import Services

pytestmark = pytest.mark.e2e

TRIGGERS_MODULE = """
import anyio
from deferral.triggers import BaseTrigger, TriggerEvent


class CountdownTrigger(BaseTrigger):
    def __init__(self, ticks, label):
        super().__init__()
        self.ticks, self.label = ticks, label

    def serialize(self):
        return "e2e_custom_triggers.CountdownTrigger", {"ticks": self.ticks, "label": self.label}

    async def run(self):
        for _ in range(self.ticks):
            await anyio.sleep(0.05)
        yield TriggerEvent({"label": self.label, "ticks": self.ticks})
"""

DAG = """
from deferral import DAG, BaseOperator
from e2e_custom_triggers import CountdownTrigger


class Countdown(BaseOperator):
    def execute(self, context, event=None):  # resuming at "execute" itself is allowed
        if event is None:
            self.defer(trigger=CountdownTrigger(ticks=3, label="go"), method_name="execute")
        return event


with DAG("e2e_custom") as dag:
    Countdown(task_id="countdown")
"""


def test_custom_trigger_from_the_dags_folder(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_custom_triggers", TRIGGERS_MODULE)
    write_dag("e2e_custom_dag", DAG)
    services.env["DEFERRAL_TRIGGER_MODULES"] = "deferral.triggers,e2e_custom_triggers"
    services.start("scheduler")
    services.start("worker", "--concurrency", "1")
    services.start("triggerer")

    done = services.run(
        "dags", "trigger", "e2e_custom", "--run-id", "r1", "--wait", "--timeout", "60"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    value = DatabaseXComs(sessions).pull("e2e_custom", "r1", "countdown", "return_value", -1)
    assert value == {"label": "go", "ticks": 3}
