"""``deferral users``: who may log in to the web UI (passwords are stored as argon2 hashes)."""

from __future__ import annotations

import sys

import click
from sqlalchemy import select

from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.tables import User
from deferral_cli.common import emit, fail, output_options, sessions
from webserver import users as accounts


@command_group()
def users() -> None:
    """Web UI users (`deferral webserver`)."""


def _read_password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    entered: str = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    return entered


@users.command("create")
@click.argument("username")
@click.option(
    "--password-stdin",
    is_flag=True,
    help="Read the password from the first line of standard input instead of asking for it.",
)
def users_create(username: str, password_stdin: bool) -> None:
    """Add USERNAME, who may then log in to the web UI and act there (trigger, pause, clear,
    mark). The password is asked for twice (at least 8 characters) and stored as an argon2
    hash."""
    try:
        accounts.check_username(username)
    except accounts.UserError as exc:
        fail(str(exc))
        return
    factory = sessions(settings_or_exit())
    # Before asking for a password: the name must be free and the database must answer.
    with factory() as session:
        if session.scalar(select(User.id).where(User.username == username)) is not None:
            fail(f"user {username!r} exists already")
    try:
        password = accounts.check_password(_read_password(password_stdin))
    except accounts.UserError as exc:
        fail(str(exc))
        return
    with factory.begin() as session:
        created = accounts.create_user(session, username, password)
    if not created:
        fail(f"user {username!r} exists already")
    click.echo(f"user {username} created")
    if username == accounts.ENV_ADMIN and accounts.admin_password() is not None:
        click.echo(
            f"note: while {accounts.ADMIN_PASSWORD_ENV} is set, {username} logs in with that"
            " password instead",
            err=True,
        )


@users.command("list")
@output_options
def users_list(output: str) -> None:
    """List the users (never their passwords)."""
    with sessions(settings_or_exit())() as session:
        rows = session.execute(select(User.username, User.created_at).order_by(User.username))
        records = [{"username": name, "created_at": created} for name, created in rows]
    emit(output, records, empty="no users")


@users.command("delete")
@click.argument("username")
def users_delete(username: str) -> None:
    """Remove USERNAME; their sessions end with their next request."""
    with sessions(settings_or_exit()).begin() as session:
        removed = accounts.delete_user(session, username)
    if not removed:
        fail(f"no user {username!r}")
    click.echo(f"user {username} deleted")
