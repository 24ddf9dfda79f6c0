"""The one line that says a server (PostgreSQL, Redis) cannot be reached or lacks the schema,
shared by the CLI (which exits with its status) and the web UI (which shows it)."""

from __future__ import annotations

import re

import psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from deferral.runtime.config import Settings
from deferral.runtime.faults import is_transient, loaded_redis_errors
from deferral.store.db import url_location


class NotFound(LookupError):
    """What a page, an API call or a command names does not exist; the message says what."""


# Exit statuses every command shares (click itself exits 2 on a usage error).
EXIT_FAILED = 1
EXIT_UNAVAILABLE = 2

# SQLSTATE undefined_table: the schema is missing (or older than this command).
_UNDEFINED_TABLE = "42P01"
_UNREACHABLE_REDIS = ("ConnectionError", "TimeoutError")
# Subclasses of ConnectionError in redis-py, yet the server answered: it is busy.
_BUSY_REDIS = ("BusyLoadingError", "ReadOnlyError", "TryAgainError")


def server_error(exc: BaseException, settings: Settings | None) -> tuple[str, int] | None:
    """The one line (and exit status) for an error that says a server is unavailable, found in
    ``exc`` or the exceptions it was raised from; None for any other error."""
    cause: BaseException | None = exc
    while cause is not None:
        said = _server_error(cause, settings)
        if said is not None:
            return said
        cause = cause.__cause__
    return None


def _server_error(exc: BaseException, settings: Settings | None) -> tuple[str, int] | None:
    # An error of redis-py's exists only once it was imported (faults.loaded_redis_errors).
    redis_errors = loaded_redis_errors()
    if redis_errors is not None and isinstance(exc, redis_errors.RedisError) and is_transient(exc):
        where = "Redis" if settings is None else f"Redis at {_redis_place(settings.redis_url)}"
        unreachable = tuple(getattr(redis_errors, name) for name in _UNREACHABLE_REDIS)
        busy = tuple(getattr(redis_errors, name) for name in _BUSY_REDIS)
        if isinstance(exc, unreachable) and not isinstance(exc, busy):
            return f"cannot reach {where}: {_redis_reason(exc)}", EXIT_UNAVAILABLE
        return f"{where} is busy: {_first_line(exc)}; try again", EXIT_UNAVAILABLE
    if not isinstance(exc, DBAPIError):
        return None
    where = "PostgreSQL" if settings is None else f"PostgreSQL at {_db_place(settings)}"
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if is_transient(exc):
        reason = _postgres_reason(exc.orig)
        if sqlstate is None or sqlstate.startswith(("08", "57")) or exc.connection_invalidated:
            return f"cannot reach {where}: {reason}", EXIT_UNAVAILABLE
        return f"{where} is busy: {reason}; try again", EXIT_UNAVAILABLE
    if sqlstate == _UNDEFINED_TABLE:
        return (
            f"{where} lacks deferral's tables (or some of them): run `deferral db upgrade`",
            EXIT_FAILED,
        )
    return None


def _db_place(settings: Settings) -> str:
    try:
        return url_location(make_url(settings.database_url))
    except ArgumentError:
        return "?"


def _redis_place(url: str) -> str:
    from broker.client import redis_location  # only when redis-py is in use (see above)

    try:
        return redis_location(url)
    except ValueError:
        return "?"


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


def _lower_first(text: str) -> str:
    """Lower-case a sentence's first letter ("Connection refused"), not an acronym's ("FATAL")."""
    return text[0].lower() + text[1:] if text[1:2].islower() else text


# What libpq puts before the reason; the place is said already.
_LIBPQ_PREFIXES = (
    re.compile(r"^connection (?:failed|is bad): "),
    re.compile(r"^connection to server (?:at|on) .*? failed: "),
    re.compile(r"^FATAL:\s+"),
)


def _postgres_reason(orig: BaseException | None) -> str:
    """libpq's reason, without the place it repeats: "connection refused"."""
    line = _first_line(orig)
    if isinstance(orig, psycopg.Error):
        for prefix in _LIBPQ_PREFIXES:
            line = prefix.sub("", line)
    return _lower_first(line.strip()) if line.strip() else type(orig).__name__


def _redis_reason(exc: BaseException) -> str:
    """The operating system's reason (connection refused, name or service not known) when the
    socket failed, else Redis's own message."""
    context = exc.__context__
    while context is not None:
        if isinstance(context, OSError) and context.strerror:
            return _lower_first(context.strerror)
        context = context.__context__
    return _first_line(exc)
