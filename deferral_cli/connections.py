"""``deferral connections``: add, get, list and delete Connections; a password is never shown."""

from __future__ import annotations

import json
import os

import click
from sqlalchemy import select

from deferral.connections import (
    Connection,
    ConnectionExists,
    ConnectionNotFound,
    InvalidConnection,
    add_stored,
    delete_stored,
    env_name,
    from_environment,
    read_stored,
)
from deferral.runtime.process import command_group, settings_or_exit
from deferral.runtime.secrets_masker import MASK
from deferral.store.metastore import metastore
from deferral.store.tables import StoredConnection
from deferral_cli.common import emit, fail, output_options


@command_group()
def connections() -> None:
    """Connections to external systems (DEFERRAL_CONN_<CONN_ID> wins over the table)."""


@connections.command("add")
@click.argument("conn_id")
@click.option("--conn-uri", default=None, help="postgres://user:pass@host:5432/db?param=x")
@click.option("--conn-json", default=None, help='{"conn_type": "postgres", "host": ...}')
@click.option("--conn-type", default=None, help="The connection type (postgres, http...).")
@click.option("--conn-host", default=None, help="The host to connect to.")
@click.option("--conn-login", default=None, help="The user name to connect as.")
@click.option(
    "--conn-password", default=None, help="The password (stored encrypted, never printed)."
)
@click.option("--conn-schema", default=None, help="The schema (a database name, for most types).")
@click.option(
    "--conn-port", type=click.IntRange(0, 65535), default=None, help="The port to connect to."
)
@click.option("--conn-extra", default=None, help="A JSON object of extra settings.")
@click.option("--conn-description", default=None, help="Free text about the connection.")
def connections_add(
    conn_id: str,
    conn_uri: str | None,
    conn_json: str | None,
    conn_type: str | None,
    conn_host: str | None,
    conn_login: str | None,
    conn_password: str | None,
    conn_schema: str | None,
    conn_port: int | None,
    conn_extra: str | None,
    conn_description: str | None,
) -> None:
    """Add CONN_ID from --conn-uri, --conn-json, or --conn-type and the other --conn-* fields;
    the password and the extra are stored encrypted."""
    settings_or_exit()
    fields = (conn_type, conn_host, conn_login, conn_password, conn_schema, conn_port, conn_extra)
    forms = (("--conn-uri", conn_uri), ("--conn-json", conn_json))
    given = [name for name, value in forms if value is not None]
    if any(value is not None for value in fields):
        given.append("--conn-type and the other fields")
    if not given:
        fail("give --conn-uri, --conn-json, or --conn-type (with the other --conn-* fields)")
    if len(given) > 1:
        fail(f"give only one of {', '.join(given)}")
    try:
        if conn_uri is not None:
            conn = Connection(conn_id=conn_id, uri=conn_uri, description=conn_description)
        elif conn_json is not None:
            conn = Connection.from_json(conn_json, conn_id=conn_id)
            conn.description = conn_description or conn.description
        else:
            if not conn_type:
                fail("--conn-type is required unless --conn-uri or --conn-json is given")
            conn = Connection(
                conn_id=conn_id,
                conn_type=conn_type,
                description=conn_description,
                host=conn_host,
                login=conn_login,
                password=conn_password,
                schema=conn_schema,
                port=conn_port,
                extra=conn_extra,
            )
        store = metastore()
        with store.sessions.begin() as session:
            add_stored(session, store.cipher, conn)
    except (InvalidConnection, ConnectionExists) as exc:
        fail(str(exc))
        return
    click.echo(f"Successfully added conn_id={conn_id}: {conn.masked_uri()}")
    if env_name(conn_id) in os.environ:
        click.echo(
            f"warning: {env_name(conn_id)} is set and takes precedence over the table", err=True
        )


@connections.command("get")
@click.argument("conn_id")
def connections_get(conn_id: str) -> None:
    """Show CONN_ID (the environment's DEFERRAL_CONN_<CONN_ID> first, then the table), its
    password masked, and masked values of extra keys that look secret."""
    settings_or_exit()
    try:
        conn = from_environment(conn_id)
        source = f"environment ({env_name(conn_id)})"
        if conn is None:
            store = metastore()
            with store.sessions() as session:
                conn = read_stored(session, store.cipher, conn_id)
            source = "table"
        if conn is None:
            raise ConnectionNotFound(f"The conn_id `{conn_id}` isn't defined")
    except (InvalidConnection, ConnectionNotFound) as exc:
        fail(str(exc))
        return
    shown = [
        ("conn_id", conn.conn_id),
        ("conn_type", conn.conn_type),
        ("description", conn.description),
        ("host", conn.host),
        ("schema", conn.schema),
        ("login", conn.login),
        ("password", None if conn.password is None else MASK),
        ("port", None if conn.port is None else str(conn.port)),
        ("extra", json.dumps(conn.masked_extra()) if conn.extra else None),
        ("uri", conn.masked_uri()),
        ("source", source),
    ]
    width = max(len(name) for name, _ in shown)
    for name, value in shown:
        click.echo(f"{name.ljust(width)}  {'-' if value in (None, '') else value}")


@connections.command("list")
@output_options
def connections_list(output: str) -> None:
    """List the connections of the table (a password is shown as *** if set, never in clear)."""
    settings_or_exit()
    with metastore().sessions() as session:
        rows = session.scalars(select(StoredConnection).order_by(StoredConnection.conn_id)).all()
    records = [
        {
            "conn_id": row.conn_id,
            "conn_type": row.conn_type,
            "host": row.host or None,
            "port": row.port,
            "schema": row.schema or None,
            "login": row.login or None,
            "password": None if row.password is None else MASK,
            "description": row.description or None,
        }
        for row in rows
    ]
    emit(output, records, empty="no connections")


@connections.command("delete")
@click.argument("conn_id")
def connections_delete(conn_id: str) -> None:
    """Delete CONN_ID from the table."""
    settings_or_exit()
    with metastore().sessions.begin() as session:
        deleted = delete_stored(session, conn_id)
    if not deleted:
        fail(f"no connection with conn_id {conn_id!r} in the table")
    click.echo(f"Successfully deleted connection with conn_id={conn_id}")
