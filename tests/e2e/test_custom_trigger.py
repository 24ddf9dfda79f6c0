"""A trigger class defined in a DAGs-folder module runs in the triggerer once its module is
allowed by DEFERRAL_TRIGGER_MODULES, and its payload reaches the resume method."""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.xcom import DatabaseXComs
from tests.e2e.conftest import Services
from tests.helpers import wait_for

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


BLOCKING_TRIGGERS = """
import time
from deferral.triggers import BaseTrigger, TriggerEvent


class Blocking(BaseTrigger):
    def serialize(self):
        return "e2e_blocking_triggers.Blocking", {}

    async def run(self):
        time.sleep(0.6)  # blocks the triggerer's event loop: the bug to be reported
        yield TriggerEvent("done")
"""

BLOCKING_DAG = """
from deferral import DAG, BaseOperator
from e2e_blocking_triggers import Blocking


class UsesBlocking(BaseOperator):
    def execute(self, context):
        self.defer(trigger=Blocking(), method_name="resume")

    def resume(self, context, event):
        return event


with DAG("e2e_blocking") as dag:
    UsesBlocking(task_id="blocks")
"""


def test_a_trigger_blocking_the_event_loop_is_named_in_a_warning(
    services: Services, write_dag: Any
) -> None:
    write_dag("e2e_blocking_triggers", BLOCKING_TRIGGERS)
    write_dag("e2e_blocking_dag", BLOCKING_DAG)
    services.env["DEFERRAL_TRIGGER_MODULES"] = "e2e_blocking_triggers"
    services.start("scheduler")
    services.start("worker", "--concurrency", "1")
    services.start("triggerer")
    done = services.run(
        "dags", "trigger", "e2e_blocking", "--run-id", "r1", "--wait", "--timeout", "60"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Only the Blocking trigger's warning: on a loaded machine the triggerer's own work may
    # stall the loop briefly too, and be named (as itself) in a warning of its own.
    blocked = re.compile(
        r"\(e2e_blocking_triggers\.Blocking\) for e2e_blocking\.r1\.blocks "
        r"blocked the event loop for ([0-9.]+) s"
    )
    found = wait_for(
        lambda: blocked.search(services.log("triggerer")),
        timeout=60,
        what="the blocked-loop warning naming the trigger",
    )
    assert float(found.group(1)) >= 0.55  # the block's length, or longer on a loaded machine
