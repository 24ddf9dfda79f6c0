"""Human in the loop and deadline alerts (Airflow 3.1's names).

``approve_release`` waits in state awaiting_input, holding no worker slot, pool slot or trigger,
until someone responds on the web UI's "Required actions" page, through
``POST /api/v1/hitlDetails/<id>`` or with ``deferral approvals respond <id> Approve``. Rejecting
skips ``publish`` and what follows it. ``pick_channel`` asks for one branch to follow and a
param; ``notes`` takes a free-form entry and, after a day without an answer, its default.

The DAG has a deadline: if a run has not finished an hour after it was queued, ``page_oncall``
runs once (in the scheduler that records the miss) and the miss shows on "Deadline misses".
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG
from deferral.deadline import DeadlineAlert, DeadlineReference, SyncCallback
from deferral.models.param import Param
from deferral.operators import EmptyOperator, PythonOperator
from deferral.operators.hitl import ApprovalOperator, HITLBranchOperator, HITLEntryOperator


def page_oncall(team: str, context: dict[str, Any]) -> None:
    print(f"[{team}] run {context['run_id']} of {context['dag_id']} missed {context['deadline']}")


def announce(ti: Any) -> None:
    answer = ti.xcom_pull(task_ids="pick_channel")
    print(f"announcing on {answer['chosen_options']} as {answer['params_input']['sender']}")


with DAG(
    "example_hitl",
    schedule=None,
    deadline=DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=dt.timedelta(hours=1),
        callback=SyncCallback(page_oncall, kwargs={"team": "data-platform"}),
    ),
) as dag:
    approve = ApprovalOperator(
        task_id="approve_release",
        subject="Release {{ run_id }}?",
        body="The nightly build passed. **Approve** to publish it.",
    )
    publish = EmptyOperator(task_id="publish")
    pick = HITLBranchOperator(
        task_id="pick_channel",
        subject="Where should the release be announced?",
        options=["Email", "Chat"],
        options_mapping={"Email": "announce_by_email", "Chat": "announce_in_chat"},
        params={"sender": Param("release-bot", type="string")},
    )
    notes = HITLEntryOperator(
        task_id="notes",
        subject="Release notes (optional)",
        params={"text": Param("", type="string")},
        execution_timeout=dt.timedelta(days=1),
    )
    approve >> publish >> pick
    pick >> [
        PythonOperator(task_id="announce_by_email", python_callable=announce),
        PythonOperator(task_id="announce_in_chat", python_callable=announce),
    ]
    publish >> notes
