"""The database and cipher that Variables, Connections and rendered template fields use.

Task code calls ``Variable.get`` or ``BaseHook.get_connection`` with no session at hand, in the
task's child process, in the CLI, or in a script: they open the database named by
``DEFERRAL_DATABASE_URL`` with the keys of ``DEFERRAL_FERNET_KEY``, once per process and per
value of those settings (a changed setting opens a new one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import metastore_settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient
from deferral.store.db import make_engine, make_sessionmaker

T = TypeVar("T")


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
    # In a task process, a server that refuses a connection for a moment (too many clients,
    # starting up, a failover) costs task code a wait, not its try (deferral/DECISIONS.md 107).
    event.listen(engine, "do_connect", _connect_patiently)
    store = Metastore(make_sessionmaker(engine), Cipher(fernet_keys))
    _opened.append(store)
    return store


# The metastores this process opened, and those a forked child inherited (forget_connections).
_opened: list[Metastore] = []
_inherited: list[Metastore] = []


# How long a task process keeps trying to connect while the server refuses for a reason that
# passes, and the first and longest pause between tries.
CONNECT_PATIENCE_SEC = 60.0
FIRST_PAUSE_SEC = 0.1
LONGEST_PAUSE_SEC = 2.0


# How long this process's metastore waits for a refusing server: 0 (a command says at once
# that it cannot reach it) but in a task process (``wait_for_the_server``).
_patience = 0.0


def wait_for_the_server(patience: float = CONNECT_PATIENCE_SEC) -> None:
    """From now on, a connect refused for a reason that passes is tried again for up to
    ``patience`` seconds (a worker's task process: task code would fail its try)."""
    global _patience
    _patience = patience


def _connect_patiently(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
    return patiently(lambda: dialect.connect(*cargs, **cparams), patience=_patience)


def patiently(
    connect: Callable[[], T],
    *,
    patience: float = CONNECT_PATIENCE_SEC,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``connect()``, tried again with a growing pause while it fails transiently
    (``faults.is_transient``: refused, too many clients, cannot connect now) for up to
    ``patience`` seconds; any other error, or the last transient one, is raised."""
    deadline = clock() + patience
    pause = FIRST_PAUSE_SEC
    while True:
        try:
            return connect()
        except Exception as exc:
            if not is_transient(exc) or clock() + pause > deadline:
                raise
        sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE_SEC)


def forget_connections() -> None:
    """In a forked child: open new connections when asked, never use the parent's (a
    connection shared by two processes mixes their statements: psycopg saw EMPTY_QUERY for a
    BEGIN, a connection in a transaction it never began). The parent's are kept referenced,
    never closed or collected here: closing one would end the parent's session with it."""
    _inherited.extend(_opened)
    _opened.clear()
    _open.cache_clear()
