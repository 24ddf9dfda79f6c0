"""Every change of a task instance's (and DAG run's) state, as conditional SQL.

Each transition is an ``UPDATE ... WHERE state = <from>`` so that a transition applied twice, or
by two replicas at once, changes the row at most once; the ids it really moved are returned and
recorded in ``task_state_change``. Callers own the transaction: a transition and whatever must
commit with it (an outbox row, a trigger row) go in one ``Session.begin()`` block.

The decisions of *which* rows to move (trigger rules, retry due, run finished) are pure functions
elsewhere; this module only applies them.

Split by actor: core, runs, scheduling, attempts, deferrals, awaiting_input, user_actions;
every name is available from this package as before."""

from __future__ import annotations

from deferral.transitions.attempts import Attempt as Attempt
from deferral.transitions.attempts import Started as Started
from deferral.transitions.attempts import fail as fail
from deferral.transitions.attempts import fail_poisoned as fail_poisoned
from deferral.transitions.attempts import has_tries_left as has_tries_left
from deferral.transitions.attempts import preview_start as preview_start
from deferral.transitions.attempts import reschedule as reschedule
from deferral.transitions.attempts import skip as skip
from deferral.transitions.attempts import start_many as start_many
from deferral.transitions.attempts import succeed as succeed
from deferral.transitions.attempts import succeed_many as succeed_many
from deferral.transitions.awaiting_input import await_input as await_input
from deferral.transitions.awaiting_input import resume_awaiting_input as resume_awaiting_input
from deferral.transitions.core import MARKS_RUN as MARKS_RUN
from deferral.transitions.core import TI as TI
from deferral.transitions.core import mark_runs as mark_runs
from deferral.transitions.deferrals import RESUMED_BY_TRIGGER as RESUMED_BY_TRIGGER
from deferral.transitions.deferrals import TIMED_OUT as TIMED_OUT
from deferral.transitions.deferrals import TIMED_OUT_KWARGS as TIMED_OUT_KWARGS
from deferral.transitions.deferrals import Deferral as Deferral
from deferral.transitions.deferrals import FiredEvent as FiredEvent
from deferral.transitions.deferrals import Resumed as Resumed
from deferral.transitions.deferrals import create_trigger as create_trigger
from deferral.transitions.deferrals import defer as defer
from deferral.transitions.deferrals import defer_many as defer_many
from deferral.transitions.deferrals import drop_trigger as drop_trigger
from deferral.transitions.deferrals import expire_deferrals as expire_deferrals
from deferral.transitions.deferrals import resume as resume
from deferral.transitions.deferrals import resume_many as resume_many
from deferral.transitions.deferrals import resume_point as resume_point
from deferral.transitions.runs import DAGRUN_TIMED_OUT as DAGRUN_TIMED_OUT
from deferral.transitions.runs import NewDagRun as NewDagRun
from deferral.transitions.runs import NewTaskInstance as NewTaskInstance
from deferral.transitions.runs import add_task_instances as add_task_instances
from deferral.transitions.runs import create_dag_run as create_dag_run
from deferral.transitions.runs import create_dag_runs_once as create_dag_runs_once
from deferral.transitions.runs import delete_dag_run as delete_dag_run
from deferral.transitions.runs import evaluated as evaluated
from deferral.transitions.runs import expand_mapped_task as expand_mapped_task
from deferral.transitions.runs import fail_unfinished as fail_unfinished
from deferral.transitions.runs import finish_dag_run as finish_dag_run
from deferral.transitions.runs import reopen_dag_run as reopen_dag_run
from deferral.transitions.runs import start_dag_run as start_dag_run
from deferral.transitions.runs import time_out_dag_run as time_out_dag_run
from deferral.transitions.scheduling import dispatch as dispatch
from deferral.transitions.scheduling import never_run as never_run
from deferral.transitions.scheduling import schedule as schedule
from deferral.transitions.scheduling import set_retry_due as set_retry_due
from deferral.transitions.scheduling import skip_tasks as skip_tasks
from deferral.transitions.scheduling import wake_due as wake_due
from deferral.transitions.user_actions import USER_SETTABLE_FROM as USER_SETTABLE_FROM
from deferral.transitions.user_actions import clear as clear
from deferral.transitions.user_actions import mark as mark
