"""Waiting for a person's approval as a wait, not a task state: ``ApprovalTrigger`` asks what an
``HITLOperator`` asks (a subject, options) and is answered from the same places (the Approvals
page, ``deferral approvals respond``, ``POST /api/v1/hitlDetails/{id}``), usually as a branch of
an ``AnyOf`` beside a timer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deferral.triggers.base import classpath_of
from deferral.triggers.signal import RowTrigger, SignalError

# The wait row's key of a task's approval: '/' is not a signal key's character, so no signal
# sent reaches it.
APPROVAL_KEY_PREFIX = "approval/"


def approval_key(task_instance_id: int) -> str:
    """The ``signal_wait`` key of the approval task instance ``task_instance_id`` waits for."""
    return f"{APPROVAL_KEY_PREFIX}{task_instance_id}"


class ApprovalTrigger(RowTrigger):
    """Resumes the task when a person answers its request (``subject``, ``body``, one of the
    ``options``, or several if ``multiple``): ``{"chosen_options", "responded_by_user",
    "responded_at"}``. It has no timeout of its own: put it in an ``AnyOf`` with a time branch.

    Nothing runs for it in a triggerer: the deferral records the request (listed as the
    HITLOperator's are) and a wait row, and the answering transaction resumes the task."""

    def __init__(
        self,
        subject: str,
        options: Sequence[str] = ("approve", "reject"),
        body: str | None = None,
        multiple: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(subject, str) or not subject:
            raise SignalError(
                f"approval subject {subject!r:.60} is invalid: use a non-empty string"
            )
        if isinstance(options, str) or not all(isinstance(o, str) and o for o in options):
            raise SignalError(
                f"approval options {options!r:.80} are invalid: use non-empty strings"
            )
        if not options or len(set(options)) != len(options):
            raise SignalError(
                f"approval options {list(options)!r:.80} must be unique, at least one"
            )
        if body is not None and not isinstance(body, str):
            raise SignalError(f"approval body must be a string, got {type(body).__name__}")
        self.subject = subject
        self.options = list(options)
        self.body = body
        self.multiple = bool(multiple)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(ApprovalTrigger), {
            "subject": self.subject,
            "options": self.options,
            "body": self.body,
            "multiple": self.multiple,
        }


APPROVAL_TRIGGER = classpath_of(ApprovalTrigger)
