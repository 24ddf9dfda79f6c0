"""Every change of a task instance's (and DAG run's) state, as conditional SQL.

Each transition is an ``UPDATE ... WHERE state = <from>`` so that a transition applied twice, or
by two replicas at once, changes the row at most once; the ids it really moved are returned and
recorded in ``task_state_change``. Callers own the transaction: a transition and whatever must
commit with it (an outbox row, a trigger row) go in one ``Session.begin()`` block.

The decisions of *which* rows to move (trigger rules, retry due, run finished) are pure functions
elsewhere; this module only applies them.

Split by actor: core, runs, scheduling, attempts, deferrals, shared, user_actions;
every name is available from this package as before."""

from __future__ import annotations

from deferral.store.transitions.asset_events import (
    annotate_outlet_events as annotate_outlet_events,
)
from deferral.store.transitions.asset_events import (
    partition_outlet_events as partition_outlet_events,
)
from deferral.store.transitions.asset_events import (
    record_alias_events as record_alias_events,
)
from deferral.store.transitions.attempts import Attempt as Attempt
from deferral.store.transitions.attempts import Started as Started
from deferral.store.transitions.attempts import fail as fail
from deferral.store.transitions.attempts import fail_poisoned as fail_poisoned
from deferral.store.transitions.attempts import hand_back as hand_back
from deferral.store.transitions.attempts import has_tries_left as has_tries_left
from deferral.store.transitions.attempts import preview_start as preview_start
from deferral.store.transitions.attempts import reschedule as reschedule
from deferral.store.transitions.attempts import skip as skip
from deferral.store.transitions.attempts import start_many as start_many
from deferral.store.transitions.attempts import succeed as succeed
from deferral.store.transitions.attempts import succeed_many as succeed_many
from deferral.store.transitions.attempts import succeed_recording as succeed_recording
from deferral.store.transitions.awaiting_input import await_input as await_input
from deferral.store.transitions.awaiting_input import resume_awaiting_input as resume_awaiting_input
from deferral.store.transitions.core import MARKS_RUN as MARKS_RUN
from deferral.store.transitions.core import TI as TI
from deferral.store.transitions.core import mark_runs as mark_runs
from deferral.store.transitions.deferrals import CANCELLED_BY as CANCELLED_BY
from deferral.store.transitions.deferrals import RESUMED_BY_TRIGGER as RESUMED_BY_TRIGGER
from deferral.store.transitions.deferrals import TIMED_OUT as TIMED_OUT
from deferral.store.transitions.deferrals import TIMED_OUT_KWARGS as TIMED_OUT_KWARGS
from deferral.store.transitions.deferrals import Deferral as Deferral
from deferral.store.transitions.deferrals import FiredEvent as FiredEvent
from deferral.store.transitions.deferrals import Resumed as Resumed
from deferral.store.transitions.deferrals import cancel_waiting as cancel_waiting
from deferral.store.transitions.deferrals import create_trigger as create_trigger
from deferral.store.transitions.deferrals import defer as defer
from deferral.store.transitions.deferrals import defer_many as defer_many
from deferral.store.transitions.deferrals import drop_trigger as drop_trigger
from deferral.store.transitions.deferrals import expire_deferrals as expire_deferrals
from deferral.store.transitions.deferrals import resume as resume
from deferral.store.transitions.deferrals import resume_many as resume_many
from deferral.store.transitions.deferrals import resume_point as resume_point
from deferral.store.transitions.runs import DAGRUN_TIMED_OUT as DAGRUN_TIMED_OUT
from deferral.store.transitions.runs import NewDagRun as NewDagRun
from deferral.store.transitions.runs import NewTaskInstance as NewTaskInstance
from deferral.store.transitions.runs import add_task_instances as add_task_instances
from deferral.store.transitions.runs import create_dag_run as create_dag_run
from deferral.store.transitions.runs import create_dag_runs_once as create_dag_runs_once
from deferral.store.transitions.runs import delete_dag_run as delete_dag_run
from deferral.store.transitions.runs import evaluated as evaluated
from deferral.store.transitions.runs import evaluated_many as evaluated_many
from deferral.store.transitions.runs import expand_mapped_task as expand_mapped_task
from deferral.store.transitions.runs import fail_unfinished as fail_unfinished
from deferral.store.transitions.runs import finish_dag_run as finish_dag_run
from deferral.store.transitions.runs import reopen_dag_run as reopen_dag_run
from deferral.store.transitions.runs import start_dag_run as start_dag_run
from deferral.store.transitions.runs import start_dag_runs as start_dag_runs
from deferral.store.transitions.runs import time_out_dag_run as time_out_dag_run
from deferral.store.transitions.scheduling import dispatch as dispatch
from deferral.store.transitions.scheduling import never_run as never_run
from deferral.store.transitions.scheduling import schedule as schedule
from deferral.store.transitions.scheduling import set_retry_due as set_retry_due
from deferral.store.transitions.scheduling import skip_tasks as skip_tasks
from deferral.store.transitions.scheduling import wake_due as wake_due
from deferral.store.transitions.shared import drop_unwaited as drop_unwaited
from deferral.store.transitions.shared import share_key as share_key
from deferral.store.transitions.user_actions import USER_SETTABLE_FROM as USER_SETTABLE_FROM
from deferral.store.transitions.user_actions import clear as clear
from deferral.store.transitions.user_actions import mark as mark
