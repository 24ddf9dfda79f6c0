"""``deferral variables``: get, set, list, delete, import and export Variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from sqlalchemy import select

from deferral.runtime.private_files import write_private
from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.metastore import metastore
from deferral.store.tables import StoredVariable
from deferral.variables import (
    NO_DEFAULT,
    Variable,
    VariableError,
    VariableNotFound,
    check_key,
    encode,
    stored_values,
    write_stored,
)
from deferral_cli.common import emit, fail, output_options


@command_group()
def variables() -> None:
    """Variables: named values for tasks and templates (DEFERRAL_VAR_<KEY> wins over the table)."""


@variables.command("get")
@click.argument("key")
@click.option("-j", "--json", "as_json", is_flag=True, help="Parse the value as JSON.")
@click.option("-d", "--default", default=None, help="Printed when the variable does not exist.")
def variables_get(key: str, as_json: bool, default: str | None) -> None:
    """Print the value of KEY (the environment's DEFERRAL_VAR_<KEY> first, then the table)."""
    settings_or_exit()
    try:
        value = Variable.get(
            key, default_var=NO_DEFAULT if default is None else default, deserialize_json=as_json
        )
    except (VariableNotFound, VariableError) as exc:
        fail(str(exc))
        return
    click.echo(json.dumps(value, indent=2) if as_json and value is not default else value)


@variables.command("set")
@click.argument("key")
@click.argument("value")
@click.option("-j", "--json", "as_json", is_flag=True, help="VALUE is JSON; store it as JSON.")
@click.option("--description", default=None, help="What the variable is for.")
def variables_set(key: str, value: str, as_json: bool, description: str | None) -> None:
    """Store VALUE under KEY (encrypted with DEFERRAL_FERNET_KEY)."""
    settings_or_exit()
    stored: Any = value
    if as_json:
        try:
            stored = json.loads(value)
        except json.JSONDecodeError as exc:
            fail(f"VALUE of {key!r} is not valid JSON: {exc}")
            return
    try:
        Variable.set(key, stored, description=description, serialize_json=as_json)
    except VariableError as exc:
        fail(str(exc))
    click.echo(f"Variable {key} created")


@variables.command("list")
@output_options
def variables_list(output: str) -> None:
    """List the variables of the table (keys and descriptions, never values)."""
    settings_or_exit()
    with metastore().sessions() as session:
        rows = session.execute(
            select(StoredVariable.key, StoredVariable.description).order_by(StoredVariable.key)
        ).all()
    records = [{"key": key, "description": description} for key, description in rows]
    emit(output, records, empty="no variables")


@variables.command("delete")
@click.argument("key")
def variables_delete(key: str) -> None:
    """Delete KEY from the table."""
    settings_or_exit()
    try:
        deleted = Variable.delete(key)
    except VariableError as exc:
        fail(str(exc))
        return
    if not deleted:
        fail(f"Variable {key} does not exist")
    click.echo(f"Variable {key} deleted")


@variables.command("import")
@click.argument("filepath", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-a",
    "--action-on-existing-key",
    type=click.Choice(["overwrite", "fail", "skip"]),
    default="overwrite",
    show_default=True,
    help="What to do with a key the table already holds.",
)
def variables_import(filepath: Path, action_on_existing_key: str) -> None:
    """Import a JSON file of {"key": value, ...} (a string value is stored as is, any other
    value as JSON), all in one transaction."""
    settings_or_exit()
    try:
        loaded = json.loads(filepath.read_text())
    except OSError as exc:
        fail(f"cannot read {filepath}: {exc.strerror}")
        return
    except json.JSONDecodeError as exc:
        fail(f"{filepath} is not valid JSON: {exc}")
        return
    if not isinstance(loaded, dict):
        fail(f"{filepath} must hold a JSON object of variables, not {type(loaded).__name__}")
        return
    try:
        written, skipped = _import(loaded, action_on_existing_key)
    except (VariableError, VariableNotFound) as exc:
        fail(f"{filepath}: {exc}; nothing imported")
        return
    click.echo(f"{written} of {len(loaded)} variables successfully updated.")
    if skipped:
        click.echo(f"skipped, as they already exist: {', '.join(skipped)}")


def _import(loaded: dict[str, Any], action: str) -> tuple[int, list[str]]:
    store = metastore()
    with store.sessions.begin() as session:
        existing = set(
            session.scalars(select(StoredVariable.key).where(StoredVariable.key.in_(loaded)))
        )
        if action == "fail" and existing:
            raise VariableError(f"these keys already exist: {', '.join(sorted(existing))}")
        skipped = sorted(existing) if action == "skip" else []
        written = 0
        for key, value in loaded.items():
            if key in skipped:
                continue
            check_key(key)
            text = encode(key, value, serialize_json=not isinstance(value, str))
            write_stored(session, store.cipher, key, text)
            written += 1
    return written, skipped


@variables.command("export")
@click.argument("filepath", type=click.Path(dir_okay=False, writable=True, path_type=Path))
def variables_export(filepath: Path) -> None:
    """Write every variable of the table to a JSON file (values that are JSON as JSON). The file
    holds the values in clear: it is created readable by its owner only (mode 0600)."""
    settings_or_exit()
    store = metastore()
    try:
        with store.sessions() as session:
            texts = stored_values(session, store.cipher)
    except VariableError as exc:
        fail(str(exc))
        return
    exported = {key: _json_or_text(text) for key, text in texts.items()}
    try:
        write_private(filepath, json.dumps(exported, sort_keys=True, indent=4) + "\n")
    except OSError as exc:
        fail(f"cannot write {filepath}: {exc.strerror}")
    click.echo(f"{len(exported)} variables successfully exported to {filepath}")


def _json_or_text(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
