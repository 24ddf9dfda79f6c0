"""Connections: where and how to reach an external system, as Airflow's ``Connection``.

``Connection.get_connection_from_secrets(conn_id)`` (and ``BaseHook.get_connection``) reads the
environment first, ``DEFERRAL_CONN_<CONN_ID>`` holding an Airflow-style URI
(``postgres://user:pass@host:5432/db?sslmode=require``) or the JSON form
(``{"conn_type": "postgres", "host": ..., "extra": {...}}``), then the ``connection`` table,
where the password and the extra are Fernet tokens. Templates read them as
``{{ conn.my_db.host }}``. A password is never shown: ``repr`` is the conn_id, and rendered
fields mask it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlencode, urlsplit

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.runtime.secrets_masker import MASK, SecretsMasker, mask_secret
from deferral.store.seam import StoredConnection, metastore

log = logging.getLogger("deferral.connections")

ENV_PREFIX = "DEFERRAL_CONN_"
MAX_ID_LENGTH = 250
_FIELDS = ("conn_type", "description", "host", "login", "password", "schema", "port", "extra")


class ConnectionNotFound(LookupError):
    """No connection has this conn_id."""


class InvalidConnection(ValueError):
    """A connection's URI, JSON or fields are malformed, or it cannot be decrypted; the message
    names the connection."""


class ConnectionExists(ValueError):
    """``add`` of a conn_id the table already holds."""


def env_name(conn_id: str) -> str:
    return ENV_PREFIX + conn_id.upper()


def check_conn_id(conn_id: object) -> str:
    if not isinstance(conn_id, str) or not conn_id.strip() or any(c.isspace() for c in conn_id):
        raise InvalidConnection(f"conn_id {conn_id!r} is invalid: use a non-empty word")
    if len(conn_id) > MAX_ID_LENGTH:
        raise InvalidConnection(f"conn_id {conn_id[:40]!r}... is longer than {MAX_ID_LENGTH}")
    return conn_id


def normalize_conn_type(conn_type: str) -> str:
    """As Airflow: the URI scheme ``postgresql`` is the type ``postgres``; ``-`` becomes ``_``."""
    if conn_type == "postgresql":
        return "postgres"
    return conn_type.replace("-", "_")


def _hostname(parts: SplitResult) -> str:
    """The host of a split URI, unquoted; a quoted '/' (a socket path) is kept whole."""
    hostname = unquote(parts.hostname or "")
    if "/" in hostname:
        hostname = parts.netloc.rsplit("@", 1)[-1].split(":", 1)[0]
        hostname = unquote(hostname)
    return hostname


def parse_uri(uri: str) -> dict[str, Any]:
    """The fields of an Airflow connection URI; InvalidConnection (without the conn_id, which
    the caller adds) says what is wrong and never repeats the URI, which may hold a password."""
    schemes = uri.count("://")
    if schemes == 0:
        raise InvalidConnection("no '<conn_type>://' at its start")
    if schemes > 2:
        raise InvalidConnection("more than two '://' in it")
    scheme = urlsplit(uri).scheme
    if not scheme or uri.index("://") != len(scheme):
        raise InvalidConnection("no '<conn_type>://' at its start")
    # conn_type://protocol://host...: the host keeps its own protocol, as in Airflow.
    with_protocol = schemes == 2
    rest = uri[len(scheme) + 3 :]
    if with_protocol:
        protocol_part = rest.split("://", 1)[0]
        if "@" in protocol_part or ":" in protocol_part:
            raise InvalidConnection("a second '://' that does not follow a host protocol")
    parts = urlsplit(rest if with_protocol else "//" + rest)
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidConnection(f"bad port: {exc}") from None
    host = _hostname(parts)
    if with_protocol and host:
        host = f"{parts.scheme}://{host}"
    extra: str | None = None
    if parts.query:
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        if Connection.EXTRA_KEY in query:
            if len(query) > 1:
                raise InvalidConnection(
                    f"'{Connection.EXTRA_KEY}' must be the only query parameter when given"
                )
            extra = query[Connection.EXTRA_KEY]
        else:
            extra = json.dumps(query)
    return {
        "conn_type": normalize_conn_type(scheme),
        "host": host or None,
        "schema": unquote(parts.path[1:]) or None,
        "login": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "port": port,
        "extra": extra,
    }


def _extra_text(value: Any) -> str | None:
    """The extra as JSON text of an object; InvalidConnection otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidConnection(f"extra is not valid JSON: {exc}") from None
    else:
        parsed = value
    if not isinstance(parsed, dict):
        raise InvalidConnection(f"extra must be a JSON object, not {type(parsed).__name__}")
    return value if isinstance(value, str) else json.dumps(value)


def _port(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise InvalidConnection(f"port must be an integer, not {value!r}") from None
    if not 0 <= port <= 65535:
        raise InvalidConnection(f"port {port} is out of range 0-65535")
    return port


class Connection:
    """An Airflow-style connection: ``conn_type``, ``host``, ``schema``, ``login``,
    ``password``, ``port``, ``extra`` (JSON text; ``extra_dejson`` parses it), ``get_uri()``."""

    EXTRA_KEY = "__extra__"

    def __init__(
        self,
        conn_id: str | None = None,
        conn_type: str | None = None,
        description: str | None = None,
        host: str | None = None,
        login: str | None = None,
        password: str | None = None,
        schema: str | None = None,
        port: int | str | None = None,
        extra: str | dict[str, Any] | None = None,
        uri: str | None = None,
    ) -> None:
        self.conn_id = None if conn_id is None else check_conn_id(conn_id)
        self.description = description
        where = f"connection {conn_id!r}" if conn_id else "connection"
        try:
            if uri is not None:
                if any(v for v in (conn_type, host, login, password, schema, port, extra)):
                    raise InvalidConnection(
                        "give either a URI or the separate fields (conn_type, host, login, "
                        "password, schema, port, extra), not both"
                    )
                fields = parse_uri(uri)
            else:
                fields = {
                    "conn_type": normalize_conn_type(conn_type) if conn_type else conn_type,
                    "host": host,
                    "login": login,
                    "password": password,
                    "schema": schema,
                    "port": port,
                    "extra": extra,
                }
            self.conn_type: str | None = fields["conn_type"]
            self.host: str | None = fields["host"]
            self.login: str | None = fields["login"]
            self.password: str | None = fields["password"]
            self.schema: str | None = fields["schema"]
            self.port: int | None = _port(fields["port"])
            self.extra: str | None = _extra_text(fields["extra"])
        except InvalidConnection as exc:
            raise InvalidConnection(f"{where}: {exc}") from None
        if self.password:
            mask_secret(self.password)
            mask_secret(quote(self.password, safe=""))
        if self.extra:
            mask_secret(self.extra_dejson)

    @classmethod
    def from_json(cls, value: str, conn_id: str | None = None) -> Connection:
        """The JSON form Airflow accepts: an object of the fields, ``extra`` an object or text."""
        where = f"connection {conn_id!r}" if conn_id else "connection"
        try:
            fields = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidConnection(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise InvalidConnection(f"{where}: the JSON form must be an object")
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise InvalidConnection(f"{where}: unknown field(s) {', '.join(unknown)}")
        return cls(conn_id=conn_id, **fields)

    @classmethod
    def get_connection_from_secrets(cls, conn_id: str) -> Connection:
        """``DEFERRAL_CONN_<CONN_ID>`` if set, else the table; ConnectionNotFound otherwise."""
        check_conn_id(conn_id)
        found = from_environment(conn_id)
        if found is None:
            store = metastore()
            with store.sessions() as session:
                found = read_stored(session, store.cipher, conn_id)
        if found is None:
            raise ConnectionNotFound(f"The conn_id `{conn_id}` isn't defined")
        return found

    @property
    def extra_dejson(self) -> dict[str, Any]:
        """The extra as a dict ({} when there is none)."""
        if not self.extra:
            return {}
        try:
            parsed = json.loads(self.extra)
        except json.JSONDecodeError:
            log.error("connection %s: extra is not valid JSON", self.conn_id)
            return {}
        return parsed if isinstance(parsed, dict) else {}

    def get_password(self) -> str | None:
        return self.password

    def get_extra(self) -> str | None:
        return self.extra

    def get_uri(self) -> str:
        """The connection as an Airflow URI (``parse_uri`` reads it back to the same fields)."""
        password = None if self.password is None else quote(self.password, safe="")
        return self._uri(password, self.extra_dejson)

    def masked_extra(self) -> dict[str, Any]:
        """The extra with the values of secret-looking keys, and the password, as ``***``."""
        masker = SecretsMasker()
        masker.add_mask(self.password)
        return dict(masker.redact(self.extra_dejson))

    def masked_uri(self) -> str:
        """``get_uri()`` with the password and secret extra values as ``***``, for display."""
        return self._uri(None if self.password is None else MASK, self.masked_extra())

    def _uri(self, password_text: str | None, extra: dict[str, Any]) -> str:
        uri = f"{self.conn_type.lower().replace('_', '-')}://" if self.conn_type else "//"
        protocol, host = None, self.host
        if self.host and "://" in self.host:
            protocol, host = self.host.split("://", 1)
        if protocol:
            uri += f"{protocol}://"
        authority = ""
        if self.login is not None:
            authority += quote(self.login, safe="")
        if password_text is not None:
            authority += ":" + password_text
        if authority:
            uri += authority + "@"
        host_block = quote(host, safe="") if host else ""
        if self.port:
            host_block += f":{self.port}" if host_block or authority else f"@:{self.port}"
        if self.schema:
            host_block += f"/{quote(self.schema, safe='')}"
        uri += host_block
        if self.extra:
            try:
                query: str | None = urlencode(extra)
            except TypeError:
                query = None
            # Only a flat object of strings reads back from query parameters as it was.
            if not (query and extra == dict(parse_qsl(query, keep_blank_values=True))):
                query = urlencode({self.EXTRA_KEY: json.dumps(extra)})
            uri += ("?" if self.schema else "/?") + query
        return uri

    def __repr__(self) -> str:
        return self.conn_id or ""


def from_environment(conn_id: str) -> Connection | None:
    """The connection ``DEFERRAL_CONN_<CONN_ID>`` defines (URI or JSON), or None."""
    name = env_name(conn_id)
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        if value.lstrip().startswith("{"):
            return Connection.from_json(value, conn_id=conn_id)
        return Connection(conn_id=conn_id, uri=value)
    except InvalidConnection as exc:
        raise InvalidConnection(f"{name}: {exc}") from None


# -- the table -------------------------------------------------------------------------------


def _open(cipher: Cipher, conn_id: str, column: str, token: str | None) -> str | None:
    if token is None:
        return None
    try:
        return cipher.decrypt(Purpose.STORED_SECRET, token).decode()
    except DecryptionError:
        raise InvalidConnection(
            f"connection {conn_id!r}: its {column} cannot be decrypted with DEFERRAL_FERNET_KEY "
            "(sealed with another key?)"
        ) from None


def from_row(cipher: Cipher, row: StoredConnection) -> Connection:
    return Connection(
        conn_id=row.conn_id,
        conn_type=row.conn_type,
        description=row.description,
        host=row.host,
        login=row.login,
        password=_open(cipher, row.conn_id, "password", row.password),
        schema=row.schema,
        port=row.port,
        extra=_open(cipher, row.conn_id, "extra", row.extra),
    )


def read_stored(session: Session, cipher: Cipher, conn_id: str) -> Connection | None:
    row = session.scalars(
        select(StoredConnection).where(StoredConnection.conn_id == conn_id)
    ).one_or_none()
    return None if row is None else from_row(cipher, row)


def add_stored(session: Session, cipher: Cipher, conn: Connection) -> None:
    """Insert ``conn``; ConnectionExists if its conn_id is taken."""
    if conn.conn_id is None:
        raise InvalidConnection("a connection needs a conn_id to be stored")
    if not conn.conn_type:
        raise InvalidConnection(f"connection {conn.conn_id!r}: conn_type is required")
    inserted = session.scalar(
        insert(StoredConnection)
        .values(
            conn_id=conn.conn_id,
            conn_type=conn.conn_type,
            description=conn.description,
            host=conn.host,
            schema=conn.schema,
            login=conn.login,
            password=None
            if conn.password is None
            else cipher.encrypt(Purpose.STORED_SECRET, conn.password.encode()),
            port=conn.port,
            extra=None
            if conn.extra is None
            else cipher.encrypt(Purpose.STORED_SECRET, conn.extra.encode()),
        )
        .on_conflict_do_nothing(index_elements=[StoredConnection.conn_id])
        .returning(StoredConnection.id)
    )
    if inserted is None:
        raise ConnectionExists(f"a connection with conn_id {conn.conn_id!r} already exists")


def delete_stored(session: Session, conn_id: str) -> int:
    result = session.execute(delete(StoredConnection).where(StoredConnection.conn_id == conn_id))
    return int(result.rowcount)  # type: ignore[attr-defined]


class ConnectionAccessor:
    """``conn`` in templates: ``{{ conn.my_db.host }}``, ``{{ conn.get('my_db') }}``."""

    def __getattr__(self, conn_id: str) -> Connection:
        if conn_id.startswith("__"):  # copy, pickle and friends probe dunders: no lookup
            raise AttributeError(conn_id)
        return Connection.get_connection_from_secrets(conn_id)

    def get(self, conn_id: str, default_conn: Any = None) -> Any:
        try:
            return Connection.get_connection_from_secrets(conn_id)
        except ConnectionNotFound:
            return default_conn

    def __repr__(self) -> str:
        return "<connections>"
