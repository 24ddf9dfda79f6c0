"""The database and cipher that Variables, Connections and rendered template fields use.

Task code calls ``Variable.get`` or ``BaseHook.get_connection`` with no session at hand, in the
task's child process, in the CLI, or in a script: they open the database named by
``DEFERRAL_DATABASE_URL`` with the keys of ``DEFERRAL_FERNET_KEY``, once per process and per
value of those settings (a changed setting opens a new one).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import metastore_settings
from deferral.runtime.crypto import Cipher
from deferral.store.db import make_engine, make_sessionmaker


@dataclass(frozen=True)
class Metastore:
    sessions: sessionmaker[Session]
    cipher: Cipher


def metastore() -> Metastore:
    """The metastore of the current settings; ConfigError names a missing or bad setting."""
    return _open(*metastore_settings())


@cache
def _open(database_url: str, fernet_keys: tuple[str, ...]) -> Metastore:
    # One kept connection: a task process or a command makes a few short queries in turn.
    # Pinged before each use: a worker's warm task process kept it across a database restart,
    # and its next task's first query failed the try (deferral/DECISIONS.md 104).
    engine = make_engine(database_url, pool_size=1, pool_pre_ping=True)
    return Metastore(make_sessionmaker(engine), Cipher(fernet_keys))


def forget_connections() -> None:
    """In a forked child: open new connections when asked, never use the parent's (a
    connection shared by two processes mixes their statements)."""
    _open.cache_clear()
