"""``deferral tokens``: API tokens for machines (stored as keyed hashes; the secret is shown
once, when made)."""

from __future__ import annotations

import click

from deferral.runtime.crypto import Cipher
from deferral.runtime.process import command_group, settings_or_exit
from deferral_cli.common import emit, fail, output_options, sessions
from webserver import tokens as api_tokens


@command_group()
def tokens() -> None:
    """API tokens for machines: signals, callbacks and runs through the web API."""


@tokens.command("create")
@click.argument("name")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    help=f"What the token may do (repeat it): {', '.join(api_tokens.SCOPES)}.",
)
def tokens_create(name: str, scopes: tuple[str, ...]) -> None:
    """Make an API token NAME and print it, once: send it as `Authorization: Bearer <token>`.
    `signals` sends signals (POST /api/v1/signals/KEY), `runs` triggers runs (POST
    /api/v1/dags/DAG_ID/runs), `callbacks` relays callback answers (POST
    /api/v1/callbacks/TOKEN)."""
    try:
        api_tokens.check_name(name)
        api_tokens.check_scopes(scopes)
    except api_tokens.TokenError as exc:
        fail(str(exc))
        return
    settings = settings_or_exit()
    with sessions(settings).begin() as session:
        made = api_tokens.create_token(session, Cipher(settings.fernet_keys), name, scopes)
    if made is None:
        fail(f"token {name!r} exists already")
        return
    click.echo(made)
    click.echo(
        f"token {name} made ({', '.join(api_tokens.check_scopes(scopes))}): it is shown this"
        " once and stored only as a keyed hash",
        err=True,
    )


@tokens.command("list")
@output_options
def tokens_list(output: str) -> None:
    """List the API tokens: name, scopes, when made (never their secrets)."""
    with sessions(settings_or_exit())() as session:
        records = api_tokens.token_list(session)
    emit(output, records, empty="no API tokens")


@tokens.command("revoke")
@click.argument("name")
def tokens_revoke(name: str) -> None:
    """Revoke the API token NAME: every request with it is refused from now on."""
    with sessions(settings_or_exit()).begin() as session:
        removed = api_tokens.revoke_token(session, name)
    if not removed:
        fail(f"no API token {name!r}")
    click.echo(f"token {name} revoked")
