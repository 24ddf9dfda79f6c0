"""Variables: named values for task code and templates, as Airflow's ``Variable``.

``Variable.get(key)`` reads the environment first (``DEFERRAL_VAR_<KEY>``, the key upper-cased),
then the ``variable`` table, where values are Fernet tokens under ``DEFERRAL_FERNET_KEY``.
Templates read them as ``{{ var.value.key }}`` and ``{{ var.json.key }}``. Values of keys whose
name looks secret (``password``, ``api_key``...) are masked in rendered fields.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.runtime.secrets_masker import mask_secret
from deferral.store.seam import StoredVariable, metastore

log = logging.getLogger("deferral.variables")

ENV_PREFIX = "DEFERRAL_VAR_"
MAX_KEY_LENGTH = 250


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()


class VariableNotFound(KeyError):
    """No Variable has this key (a KeyError, as in Airflow)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class VariableError(ValueError):
    """A Variable cannot be read or written; the message names its key."""


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key.strip():
        raise VariableError(f"variable key {key!r} is invalid: use a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise VariableError(
            f"variable key {key[:40]!r}... is {len(key)} characters long, more than "
            f"{MAX_KEY_LENGTH}"
        )
    return key


def decode(key: str, text: str, deserialize_json: bool) -> Any:
    if not deserialize_json:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise VariableError(f"variable {key!r} is not valid JSON: {exc}") from None


def encode(key: str, value: Any, serialize_json: bool) -> str:
    if not serialize_json:
        return str(value)
    try:
        return json.dumps(value, indent=2)
    except (TypeError, ValueError) as exc:
        raise VariableError(f"variable {key!r}: value cannot be written as JSON: {exc}") from None


# -- the table -------------------------------------------------------------------------------


def read_stored(session: Session, cipher: Cipher, key: str) -> str | None:
    """The stored text of ``key``, or None; a value no configured key opens raises VariableError."""
    row = session.scalars(select(StoredVariable).where(StoredVariable.key == key)).one_or_none()
    if row is None or row.val is None:
        return None
    return _plain(cipher, row)


def _plain(cipher: Cipher, row: StoredVariable) -> str | None:
    if row.val is None or not row.is_encrypted:
        return row.val
    try:
        return cipher.decrypt(Purpose.STORED_SECRET, row.val).decode()
    except DecryptionError:
        raise VariableError(
            f"variable {row.key!r} cannot be decrypted with DEFERRAL_FERNET_KEY "
            "(sealed with another key?)"
        ) from None


def write_stored(
    session: Session, cipher: Cipher, key: str, text: str, description: str | None = None
) -> None:
    """Insert or replace ``key``; a description of None keeps the one stored."""
    values: dict[str, Any] = {
        "key": key,
        "val": cipher.encrypt(Purpose.STORED_SECRET, text.encode()),
        "is_encrypted": True,
    }
    if description is not None:
        values["description"] = description
    statement = insert(StoredVariable).values(**values)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[StoredVariable.key],
            set_={name: statement.excluded[name] for name in values if name != "key"},
        )
    )


def delete_stored(session: Session, key: str) -> int:
    result = session.execute(delete(StoredVariable).where(StoredVariable.key == key))
    return int(result.rowcount)  # type: ignore[attr-defined]


def list_stored(session: Session) -> list[StoredVariable]:
    return list(session.scalars(select(StoredVariable).order_by(StoredVariable.key)))


def stored_values(session: Session, cipher: Cipher) -> dict[str, str | None]:
    """Every stored variable's text, by key (for export)."""
    return {row.key: _plain(cipher, row) for row in list_stored(session)}


# -- the API task code uses ------------------------------------------------------------------


class Variable:
    """``Variable.get`` / ``set`` / ``delete`` as in Airflow (``from deferral import Variable``)."""

    @classmethod
    def get(cls, key: str, default_var: Any = NO_DEFAULT, deserialize_json: bool = False) -> Any:
        """The value of ``key`` (parsed as JSON with ``deserialize_json``): the environment's
        ``DEFERRAL_VAR_<KEY>`` first, then the table; ``default_var`` if neither has it, else
        ``KeyError`` naming the key."""
        check_key(key)
        text = os.environ.get(env_name(key))
        if text is None:
            store = metastore()
            with store.sessions() as session:
                text = read_stored(session, store.cipher, key)
        if text is None:
            if default_var is NO_DEFAULT:
                raise VariableNotFound(f"Variable {key} does not exist")
            return default_var
        value = decode(key, text, deserialize_json)
        mask_secret(value, key)
        return value

    @classmethod
    def set(
        cls,
        key: str,
        value: Any,
        description: str | None = None,
        serialize_json: bool = False,
    ) -> None:
        """Store ``value`` (as JSON with ``serialize_json``, else as ``str(value)``)."""
        check_key(key)
        text = encode(key, value, serialize_json)
        if env_name(key) in os.environ:
            log.warning(
                "variable %s is also set in the environment (%s), which takes precedence: "
                "reads return the environment's value until it is unset",
                key,
                env_name(key),
            )
        store = metastore()
        with store.sessions.begin() as session:
            write_stored(session, store.cipher, key, text, description)

    @classmethod
    def update(cls, key: str, value: Any, serialize_json: bool = False) -> None:
        """Replace the stored value of an existing variable (KeyError if the table lacks it)."""
        check_key(key)
        store = metastore()
        with store.sessions.begin() as session:
            exists = session.scalar(select(StoredVariable.id).where(StoredVariable.key == key))
            if exists is None:
                raise VariableNotFound(f"Variable {key} does not exist")
            write_stored(session, store.cipher, key, encode(key, value, serialize_json))

    @classmethod
    def setdefault(
        cls,
        key: str,
        default: Any,
        description: str | None = None,
        deserialize_json: bool = False,
    ) -> Any:
        """The value of ``key``; if it has none, store ``default`` and return it."""
        value = cls.get(key, default_var=None, deserialize_json=deserialize_json)
        if value is not None:
            return value
        if default is None:
            raise ValueError(f"variable {key!r} has no value and the default is None")
        cls.set(key, default, description=description, serialize_json=deserialize_json)
        return default

    @classmethod
    def delete(cls, key: str) -> int:
        """Delete ``key`` from the table; how many rows went (0 or 1)."""
        check_key(key)
        with metastore().sessions.begin() as session:
            return delete_stored(session, key)


class VariableAccessor:
    """``var.value`` / ``var.json`` in templates: ``{{ var.value.key }}``,
    ``{{ var.json.key.field }}``, ``{{ var.value.get('key', 'fallback') }}``."""

    def __init__(self, *, deserialize_json: bool) -> None:
        self._deserialize_json = deserialize_json

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):  # copy, pickle and friends probe dunders: no variable lookup
            raise AttributeError(key)
        return Variable.get(key, deserialize_json=self._deserialize_json)

    def get(self, key: str, default_var: Any = NO_DEFAULT) -> Any:
        return Variable.get(key, default_var=default_var, deserialize_json=self._deserialize_json)

    def __repr__(self) -> str:
        kind = "json" if self._deserialize_json else "value"
        return f"<variables as {kind}>"
