"""What ``deferral tasks explain`` says about a task instance, line by line."""

from __future__ import annotations

import datetime as dt
from collections import Counter

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.streams import StreamKeys, task_label
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.states import FAIL_METHOD, FINISHED_STATES, DagRunState, TaskState
from deferral.store import doctor as checklist
from deferral.store import liveness, pools, queues
from deferral.store.serialized_dags import StoredDag, StoredMapping, StoredTask
from deferral.store.tables import (
    CallbackHeartbeat,
    DagRun,
    Pool,
    TaskInstance,
    TaskReschedule,
    TaskStateChange,
    Trigger,
    Triggerer,
    Worker,
)
from deferral.trigger_rules import TriggerRule, evaluate, upstream_states
from deferral.triggers.composite import COMPOSITES
from readmodel.progress import progress_lines, progress_of
from readmodel.records import when
from readmodel.waits import (
    RUNNING_COMPOSITE,
    how_to_resume,
    is_held,
    needs_key,
    row_wait_of,
    signal_key,
)

# What each trigger rule waits for, in words.
_RULE_WAITS_FOR: dict[TriggerRule, str] = {
    TriggerRule.ALL_SUCCESS: "every upstream task to succeed",
    TriggerRule.ALL_FAILED: "every upstream task to fail",
    TriggerRule.ALL_DONE: "every upstream task to finish, however it ends",
    TriggerRule.ONE_FAILED: "one upstream task to fail",
    TriggerRule.ONE_SUCCESS: "one upstream task to succeed",
    TriggerRule.NONE_FAILED: "every upstream task to finish without failing (skipped is fine)",
    TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS: (
        "every upstream task to finish without failing, and one to succeed"
    ),
    TriggerRule.NONE_SKIPPED: "every upstream task to finish without being skipped",
    TriggerRule.ALWAYS: "nothing: it runs at once",
    TriggerRule.ALL_DONE_SETUP_SUCCESS: (
        "every upstream task to finish, however it ends, and one of its setup tasks to succeed"
    ),
}


def explain(
    session: Session, settings: Settings, dag: StoredDag | None, run: DagRun, ti: TaskInstance
) -> list[str]:
    """Why ``ti`` is in its state, line by line; ``dag`` is its DAG as last parsed (None: not
    parsed, or no longer in the DAGs folder)."""
    now: dt.datetime = session.scalars(select(func.now())).one()
    label = task_label(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
    lines = [f"{label}: {ti.state} (try {ti.try_number} of at most {ti.max_tries + 1})"]
    task = dag.task_dict.get(ti.task_id) if dag is not None else None
    if dag is None:
        lines.append(
            f"  DAG {ti.dag_id!r} is not in the DAGs folder {settings.dags_folder}:"
            " no scheduler can advance this run"
        )
    elif task is None:
        lines.append(f"  task {ti.task_id!r} is no longer in DAG {dag.dag_id!r} ({dag.fileloc})")
    if run.state != DagRunState.RUNNING and ti.state not in FINISHED_STATES:
        lines.append(f"  DAG run is {run.state}")
    state = TaskState(ti.state)
    if state is TaskState.NONE:
        lines += _explain_waiting(session, dag, ti, task)
    elif state is TaskState.SCHEDULED:
        lines += _explain_scheduled(session, dag, ti)
    elif state is TaskState.QUEUED:
        stream = StreamKeys.for_redis(settings.stream_prefix, settings.redis_url).queue(ti.queue)
        lines.append(
            f"  queued since {when(ti.queued_at)} ({_relative(now, ti.queued_at)}):"
            f" waits for a worker reading {stream} (`worker consume --queue {ti.queue}`)"
        )
        lines.append(_queue_workers(session, settings, ti.queue, now))
    elif state is TaskState.RUNNING:
        resumed = f", resumed at {ti.next_method}" if ti.next_method else ""
        lines.append(
            f"  running since {when(ti.start_date)} on {ti.hostname or '-'}"
            f" (worker {ti.worker or '-'}){resumed}"
        )
        if ti.worker:
            lines.append(_running_worker(session, settings, ti.worker, now))
    elif state is TaskState.DEFERRED:
        lines += _explain_deferred(session, settings, ti, now)
    elif state is TaskState.AWAITING_INPUT:
        lines.append(
            "  awaiting a person's input (holds no worker or pool slot): respond on the web UI's"
            f" Required actions page or with `deferral approvals respond {ti.id} OPTION`"
        )
    elif state is TaskState.UP_FOR_RESCHEDULE:
        due = session.scalars(
            select(TaskReschedule.reschedule_date)
            .where(TaskReschedule.task_instance_id == ti.id)
            .order_by(TaskReschedule.id.desc())
            .limit(1)
        ).first()
        lines.append(f"  next poke due at {when(due)} ({_relative(now, due)})")
    elif state is TaskState.UP_FOR_RETRY:
        if task is None or ti.end_date is None:
            lines.append("  retry due: unknown (no end date, or the task is not in the DAG file)")
        else:
            due = ti.end_date + task.retry_delay
            lines.append(
                f"  failed at {when(ti.end_date)}, retry_delay {task.retry_delay}:"
                f" retry due at {when(due)} ({_relative(now, due)})"
            )
    if state is TaskState.UP_FOR_RETRY or state in FINISHED_STATES:
        lines += _last_change(session, ti)
    lines += progress_lines(progress_of(session, Cipher(settings.fernet_keys), ti))
    return lines + _docs(dag, task)


def _docs(dag: StoredDag | None, task: StoredTask | None) -> list[str]:
    """The task's documentation, then its DAG's (doc_md), each indented under its name."""
    found = [(f"task {name}", text) for name, text in (task.docs if task else {}).items()]
    dag_doc = dag.doc_md if dag is not None else None
    if dag_doc:
        found.append(("DAG doc_md", dag_doc))
    lines: list[str] = []
    for title, text in found:
        lines.append(f"  {title}:")
        lines += [f"    {line}".rstrip() for line in text.strip().splitlines()]
    return lines


def _explain_waiting(
    session: Session, dag: StoredDag | None, ti: TaskInstance, task: StoredTask | None
) -> list[str]:
    """State none: what the trigger rule waits for, and the upstream states it sees (every
    map index of a mapped upstream task); for a mapped task, when it expands."""
    if task is None:
        return []
    rule = TriggerRule(task.trigger_rule)
    upstream = list(task.upstream)
    unexpanded = task.mapping if ti.map_index < 0 else None
    expands = unexpanded is not None
    lines = _explain_mapped(unexpanded) if unexpanded is not None else []
    if not upstream:
        action = "expands" if expands else "schedules"
        return [*lines, f"  no upstream tasks: the scheduler {action} it once the run is running"]
    states: dict[str, dict[int, str]] = {}
    for task_id, map_index, state in session.execute(
        select(TaskInstance.task_id, TaskInstance.map_index, TaskInstance.state).where(
            TaskInstance.dag_id == ti.dag_id,
            TaskInstance.run_id == ti.run_id,
            TaskInstance.task_id.in_(upstream),
        )
    ).all():
        states.setdefault(task_id, {})[map_index] = state
    lines.append(f"  trigger rule {rule}: waits for {_RULE_WAITS_FOR[rule]}")
    for task_id in upstream:
        lines.append(f"  upstream {task_id}: {_upstream_state(states.get(task_id))}")
    if task.depends_on_past:
        lines.append(
            "  depends_on_past: also waits until its task instances in the previous run"
            + (" (the previous scheduled one: catchup)" if dag and dag.catchup else "")
            + " succeeded or were skipped"
            + (", and those of its direct downstream tasks" if task.wait_for_downstream else "")
        )
    in_dag = dag.task_dict if dag is not None else {}
    setups = [t for t in upstream if t in in_dag and in_dag[t].is_setup]
    decision = evaluate(rule, upstream_states(upstream, states), upstream_states(setups, states))
    if decision is None:
        pending = [
            t
            for t in upstream
            if any(s not in FINISHED_STATES for s in states.get(t, {-1: TaskState.NONE}).values())
        ]
        lines.append(f"  not decided yet: waits for {', '.join(pending)} to finish")
    elif decision is TaskState.SCHEDULED:
        action = "expands" if expands else "schedules"
        lines.append(f"  the rule is met: the scheduler {action} it on its next pass")
    else:
        lines.append(f"  the rule says {decision}: the scheduler sets it on its next pass")
    return lines


def _upstream_state(by_index: dict[int, str] | None) -> str:
    """An upstream task's state, or for a mapped one how many map indexes are in which."""
    if by_index is None:
        return f"{TaskState.NONE} (no task instance yet)"
    if list(by_index) == [-1]:
        return by_index[-1]
    counts = Counter(by_index.values())
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return f"mapped, {len(by_index)} map index(es): {summary}"


def _explain_mapped(mapping: StoredMapping) -> list[str]:
    """A mapped task not expanded yet: over what, and when it expands."""
    lines = [f"  mapped task, not expanded yet: {mapping.expand_input}"]
    dependencies = mapping.dependencies
    if dependencies:
        lines.append(
            f"  it expands into one task instance per value once {', '.join(dependencies)}"
            " finished and its trigger rule lets it run"
        )
    else:
        length = mapping.literal_length
        lines.append(f"  it expands into {length} task instance(s) once its trigger rule says so")
    return lines


def _explain_scheduled(session: Session, dag: StoredDag | None, ti: TaskInstance) -> list[str]:
    """State scheduled: the pool slots and run slots it needs before it is dispatched."""
    lines: list[str] = []
    if ti.next_method == FAIL_METHOD:
        lines.append("  its deferral timed out or its trigger failed: it fails when it next runs")
    elif ti.next_method:
        lines.append(f"  its trigger fired: it resumes at {ti.next_method}")
    waits_for: list[str] = []
    pool = session.get(Pool, ti.pool)
    if pool is None:
        lines.append(f"  pool {ti.pool!r} does not exist")
        waits_for.append(f"pool {ti.pool!r} to be created")
    else:
        # free_slots locks the pool row; this session is rolled back when the command ends.
        free = pools.free_slots(session, [ti.pool]).get(ti.pool, 0)
        lines.append(
            f"  pool {ti.pool}: {free} of {pool.slots} slots free, it needs {ti.pool_slots}"
        )
        if free < ti.pool_slots:
            waits_for.append("pool slots")
    if dag is not None:
        active = session.scalar(
            select(func.count())
            .select_from(TaskInstance)
            .where(
                TaskInstance.dag_id == ti.dag_id,
                TaskInstance.run_id == ti.run_id,
                TaskInstance.state.in_([TaskState.QUEUED, TaskState.RUNNING]),
            )
        )
        lines.append(
            f"  DAG max_active_tasks {dag.max_active_tasks}:"
            f" {active} task(s) of this run queued or running"
        )
        if (active or 0) >= dag.max_active_tasks:
            waits_for.append("a task of this run to finish (max_active_tasks)")
    if waits_for:
        lines.append(f"  waits for {' and '.join(waits_for)}")
    else:
        lines.append("  nothing holds it back: the scheduler dispatches it on its next pass")
    return lines


def _explain_deferred(
    session: Session, settings: Settings, ti: TaskInstance, now: dt.datetime
) -> list[str]:
    """State deferred: its trigger, the triggerer running it, the resume method and timeout."""
    trigger = session.get(Trigger, ti.trigger_id) if ti.trigger_id is not None else None
    held = trigger is None or trigger.classpath not in COMPOSITES or is_held(session, trigger.id)
    row_wait = row_wait_of(trigger.classpath, held) if trigger is not None else None
    if trigger is None:
        lines = [
            f"  waits on trigger {ti.trigger_id}, whose row is missing: nothing will resume it"
            " but its timeout (clear or mark the task)"
        ]
    elif row_wait is not None:
        key = signal_key(session, trigger.id) if needs_key(row_wait) else None
        lines = [
            f"  waits on trigger {trigger.id} ({trigger.classpath}), kept as a row: no triggerer"
            " runs it",
            f"  resumed by {how_to_resume(row_wait, key)}",
        ]
        lines += _heartbeats(session, trigger.id, now)
    elif trigger.far_moment is not None:
        publish_at = trigger.far_moment - dt.timedelta(seconds=settings.far_timer_horizon_sec)
        lines = [
            f"  waits on trigger {trigger.id} ({trigger.classpath})",
            f"  a far timer, waiting as a row until {when(trigger.far_moment)}: no triggerer"
            f" holds it; a scheduler publishes it from {when(publish_at)}"
            " (DEFERRAL_FAR_TIMER_HORIZON_SEC before its moment)",
        ]
    else:
        lines = _held(session, settings, ti, trigger, now)
        if not held:
            lines.append(f"  {RUNNING_COMPOSITE}")
    lines.append(f"  resumes at next_method {ti.next_method}")
    if ti.trigger_timeout is None:
        lines.append("  trigger_timeout: none (waits until the trigger fires)")
    else:
        left = (ti.trigger_timeout - now).total_seconds()
        if left >= 0:
            lines.append(f"  trigger_timeout {when(ti.trigger_timeout)}: {left:.0f}s left")
        elif -left <= checklist.EXPIRED_GRACE_SEC:
            lines.append(
                f"  trigger_timeout {when(ti.trigger_timeout)}: passed {-left:.0f}s ago;"
                " the scheduler fails it within a second"
            )
        else:
            lines.append(
                f"  trigger_timeout {when(ti.trigger_timeout)}: passed {-left:.0f}s ago;"
                " a running scheduler would have failed it (is `scheduler consume` running?)"
            )
    return lines


def _heartbeats(session: Session, trigger_id: int, now: dt.datetime) -> list[str]:
    """The heartbeat deadlines of a callback wait (``CallbackTrigger(heartbeat=)``)."""
    beats = session.execute(
        select(CallbackHeartbeat.every_sec, CallbackHeartbeat.due_at).where(
            CallbackHeartbeat.trigger_id == trigger_id
        )
    ).all()
    return [
        f"  heartbeat every {dt.timedelta(seconds=every)}: the next due by {when(due)}"
        f" ({_relative(now, due)}); a missed one fails the task (or retries it)"
        for every, due in beats
    ]


def _held(
    session: Session, settings: Settings, ti: TaskInstance, trigger: Trigger, now: dt.datetime
) -> list[str]:
    """A published trigger: its streams, and the triggerer running it (or why none does)."""
    keys = StreamKeys.for_redis(settings.stream_prefix, settings.redis_url, settings.stream_shards)
    lines = [
        f"  waits on trigger {trigger.id} ({trigger.classpath})",
        f"  its entry is in {keys.trigger_stream(ti.queue, trigger.id)}, its event will be"
        f" in {keys.events_for(trigger.id)} (stream shard {keys.shard_of(trigger.id)}"
        f" of {keys.shards})",
    ]
    triggerer = session.get(Triggerer, trigger.triggerer_id) if trigger.triggerer_id else None
    if trigger.triggerer_id is None:
        lines.append("  no triggerer has picked the trigger up yet")
    if triggerer is None or not liveness.is_alive(
        triggerer.state, triggerer.latest_heartbeat, now, settings.heartbeat_sec
    ):
        served = queues.served_by_live_triggerers(session, settings.heartbeat_sec)
        if queues.unserved(ti.queue, served):
            lines.append(
                f"  no live triggerer serves its queue {ti.queue!r}: start"
                f" `triggerer consume --queues {ti.queue}` (or one without --queues)"
            )
    elif triggerer is None:
        lines.append(f"  run by triggerer {trigger.triggerer_id}, which is not registered")
    else:
        age = liveness.heartbeat_age_sec(triggerer.latest_heartbeat, now)
        alive = liveness.is_alive(
            triggerer.state, triggerer.latest_heartbeat, now, settings.heartbeat_sec
        )
        lines.append(
            f"  run by triggerer {triggerer.name} on {triggerer.hostname} ({triggerer.state}),"
            f" heartbeat {age:.1f}s ago: {'alive' if alive else 'stale'}"
        )
    return lines


def _queue_workers(session: Session, settings: Settings, queue: str, now: dt.datetime) -> str:
    """How many alive workers read ``queue``."""
    workers = session.scalars(select(Worker)).all()
    alive = [
        w.name
        for w in workers
        if queues.serves(w.queue, queue)  # a worker of several queues records them all
        and liveness.is_alive(w.state, w.latest_heartbeat, now, settings.heartbeat_sec)
    ]
    if not alive:
        return f"  no worker reading queue {queue} is alive: start `worker consume --queue {queue}`"
    return f"  {len(alive)} alive worker(s) read queue {queue}: {', '.join(sorted(alive))}"


def _running_worker(session: Session, settings: Settings, name: str, now: dt.datetime) -> str:
    """Whether the worker running the attempt is alive."""
    worker = session.get(Worker, name)
    if worker is None:
        return f"  worker {name} is not registered"
    age = liveness.heartbeat_age_sec(worker.latest_heartbeat, now)
    if liveness.is_alive(worker.state, worker.latest_heartbeat, now, settings.heartbeat_sec):
        return f"  worker {name} ({worker.state}), heartbeat {age:.1f}s ago: alive"
    return (
        f"  worker {name} ({worker.state}), heartbeat {age:.1f}s ago: stale; the attempt is"
        " failed (and retried if a try is left) once a peer or the scheduler notices"
    )


def _last_change(session: Session, ti: TaskInstance) -> list[str]:
    change = session.scalars(
        select(TaskStateChange)
        .where(TaskStateChange.task_instance_id == ti.id)
        .order_by(TaskStateChange.id.desc())
        .limit(1)
    ).first()
    if change is None:
        return ["  no state change recorded"]
    reason = (change.reason or "no reason recorded").replace("\n", "\n    ")
    return [
        f"  last change: {change.from_state} -> {change.to_state} at {when(change.at)}: {reason}"
    ]


def _relative(now: dt.datetime, moment: dt.datetime | None) -> str:
    if moment is None:
        return "unknown"
    seconds = (moment - now).total_seconds()
    return f"in {seconds:.0f}s" if seconds >= 0 else f"{-seconds:.0f}s ago"
