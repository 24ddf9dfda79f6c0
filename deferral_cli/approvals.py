"""``deferral approvals list|respond``: tasks awaiting a person's input (HITLOperator and its
subclasses), and responding to one, as the web UI's "Required actions" page does."""

from __future__ import annotations

import getpass
import json
from typing import Any

import click

from deferral.runtime import storable
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import command_group, settings_or_exit
from deferral.store import hitl
from deferral_cli.common import Record, emit, fail, output_options, sessions

# The longest user name recorded (hitl_detail.responded_by).
MAX_USER_CHARS = 64


@command_group()
def approvals() -> None:
    """Human in the loop: tasks awaiting input, and responding to them."""


@approvals.command("list")
@click.option("--all", "show_all", is_flag=True, help="Also requests already responded to.")
@click.option("--dag-id", default=None, help="Only this DAG's tasks.")
@click.option(
    "--limit",
    type=click.IntRange(1, hitl.MAX_LISTED),
    default=100,
    show_default=True,
    help="At most this many, newest first.",
)
@output_options
def approvals_list(show_all: bool, dag_id: str | None, limit: int, output: str) -> None:
    """List tasks awaiting input, newest first: id (to respond with), task, subject, options,
    defaults, timeout; with --all, the responses too (who, when, what)."""
    settings = settings_or_exit()
    with sessions(settings)() as session:
        found = hitl.required_actions(session, pending=not show_all, dag_id=dag_id, limit=limit)
    records: list[Record] = [
        {
            "id": a.task_instance_id,
            "task": f"{a.dag_id}.{a.run_id}.{a.task_id}"
            + (f"[{a.map_index}]" if a.map_index >= 0 else ""),
            "state": a.state,
            "subject": a.subject,
            "options": ", ".join(a.options),
            "defaults": None if a.defaults is None else ", ".join(a.defaults),
            "params": ", ".join(a.params) or None,
            "timeout_at": a.timeout_at,
            "responded_by": a.responded_by,
            "responded_at": a.responded_at,
            "chosen": None if a.chosen_options is None else ", ".join(a.chosen_options),
        }
        for a in found
    ]
    emit(output, records, empty="no task is awaiting input")


def _params(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    if len(text) > hitl.MAX_PARAMS_BYTES:
        fail(f"--params is longer than {hitl.MAX_PARAMS_BYTES} bytes")
    try:
        value = json.loads(text)
    except ValueError as exc:
        fail(f"--params is not JSON: {exc}")
    if not isinstance(value, dict):
        fail("--params must be a JSON object")
    try:
        storable.check(value, "--params")
    except storable.UnstorableText as exc:
        fail(str(exc))
    return value


@approvals.command("respond")
@click.argument("task_instance_id", type=click.IntRange(1))
@click.argument("options", nargs=-1, required=True)
@click.option("--params", "params_text", default=None, help="params_input as a JSON object.")
@click.option(
    "--as",
    "user",
    default=None,
    help="Who responds, as recorded (default: the operating system user).",
)
def approvals_respond(
    task_instance_id: int, options: tuple[str, ...], params_text: str | None, user: str | None
) -> None:
    """Respond to task TASK_INSTANCE_ID (the id `approvals list` shows) with OPTIONS (one, or
    several where the task allows multiple): it resumes with them."""
    who = user if user is not None else getpass.getuser()
    if not who or len(who) > MAX_USER_CHARS:
        fail(f"--as must be 1-{MAX_USER_CHARS} characters")
    params = _params(params_text)
    settings = settings_or_exit()
    try:
        with sessions(settings).begin() as session:
            event = hitl.respond(
                session, Cipher(settings.fernet_keys), task_instance_id, list(options), params, who
            )
    except hitl.ResponseError as exc:
        fail(str(exc))
    chosen = ", ".join(event["chosen_options"] or [])
    click.echo(f"task instance {task_instance_id}: responded {chosen} as {who}")
