"""Masking values a process shows but did not produce: XComs in the web UI, the API and the CLI.

A task that pushes a Connection's password as an XCom registered that password with the masker
of the process that ran it; the webserver or ``deferral xcom get`` never read the Connection, so
its own masker knows nothing. :func:`known_secrets` gathers what the masker would have known:
every Connection's password and sensitive extras, and every Variable whose name marks it as
secret, from the table and from ``DEFERRAL_CONN_*`` / ``DEFERRAL_VAR_*``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from sqlalchemy import select
from sqlalchemy.orm import Session

from deferral import connections, variables
from deferral.runtime.crypto import Cipher
from deferral.runtime.secrets_masker import SecretsMasker, redact, should_hide_value_for_key
from deferral.runtime.serialization import plain_json
from deferral.store.tables import StoredConnection


def _add_connection(masker: SecretsMasker, conn: connections.Connection) -> None:
    if conn.password:
        masker.add_mask(conn.password)
        masker.add_mask(quote(conn.password, safe=""))  # as it stands in a URI
    if conn.extra:
        masker.add_mask(conn.extra_dejson)  # the values under sensitive names only


def known_secrets(
    session: Session, cipher: Cipher, environ: Mapping[str, str] | None = None
) -> SecretsMasker:
    """A masker that knows every stored and configured secret. One that cannot be opened (sealed
    with another key, malformed) is left out: no page or command fails for it."""
    environ = os.environ if environ is None else environ
    masker = SecretsMasker()
    for stored in session.scalars(select(StoredConnection)):
        try:
            _add_connection(masker, connections.from_row(cipher, stored))
        except connections.InvalidConnection:
            continue
    for variable in variables.list_stored(session):
        if should_hide_value_for_key(variable.key):
            try:
                masker.add_mask(variables.read_stored(session, cipher, variable.key))
            except variables.VariableError:
                continue
    for name, value in environ.items():
        if name.startswith(connections.ENV_PREFIX):
            try:
                if value.lstrip().startswith("{"):
                    _add_connection(masker, connections.Connection.from_json(value))
                else:
                    _add_connection(masker, connections.Connection(uri=value))
            except (connections.InvalidConnection, ValueError):
                continue
        elif name.startswith(variables.ENV_PREFIX):
            masker.add_mask(value, name.removeprefix(variables.ENV_PREFIX).lower())
    return masker


def shown_xcom(masker: SecretsMasker, key: str, stored: Any) -> Any:
    """A stored XCom value as people see it: plain JSON, every known secret masked (everything,
    under a sensitive key)."""
    return redact(masker.redact(plain_json(stored), key), key)
