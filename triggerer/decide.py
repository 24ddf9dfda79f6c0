"""Pure decisions of the triggerer, tested on their own."""

from __future__ import annotations

from deferral.states import TaskState
from deferral.store.transitions import RESUMED_BY_TRIGGER, TIMED_OUT

USER_ACTION = "user_action"
TIMEOUT = "timeout"
SUPERSEDED = "superseded"
# The longest between two looks for entries to take over: a stopping peer's hand-off is picked
# up within this, whatever the heartbeat.
TAKEOVER_LOOK_MAX_SEC = 0.5


def takeover_every(heartbeat_sec: float) -> float:
    """Seconds between looks for entries to take over: four times a heartbeat (a dead peer's
    entries are taken soon after they pass the threshold), and at most
    TAKEOVER_LOOK_MAX_SEC apart (a stopping peer's triggers run again within a second of its
    exit at the default heartbeat too)."""
    return min(heartbeat_sec / 4, TAKEOVER_LOOK_MAX_SEC)


def cancel_reason(
    trigger_id: int, ti_state: str | None, ti_trigger_id: int | None, left_deferred: str | None
) -> str | None:
    """Why a running trigger is no longer wanted by its task (None: it still is).

    ``ti_state`` and ``ti_trigger_id`` describe the task instance now (state None: the row is
    gone); ``left_deferred`` is the reason recorded when it last left the deferred state."""
    if ti_state == TaskState.DEFERRED and ti_trigger_id == trigger_id:
        return None
    if ti_state is None:
        return USER_ACTION
    if left_deferred == TIMED_OUT:
        return TIMEOUT
    if left_deferred is None or left_deferred.startswith(RESUMED_BY_TRIGGER):
        # Resumed by another copy of this trigger, or deferred again on another one since.
        return SUPERSEDED
    return USER_ACTION  # cleared or marked
