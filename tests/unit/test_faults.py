"""deferral.runtime.faults: transient errors are told from data errors by type and SQLSTATE."""

from __future__ import annotations

import psycopg
import pytest
import redis.exceptions
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError

from deferral.runtime import faults
from deferral.runtime.faults import is_transient


def _db(kind: type, orig: BaseException) -> BaseException:
    return kind("UPDATE ...", {}, orig)


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ConnectionError("down"),
        redis.exceptions.TimeoutError("slow"),
        redis.exceptions.BusyLoadingError("loading"),
        redis.exceptions.ResponseError("NOGROUP No such key 'x' or consumer group 'g'"),
        redis.exceptions.ResponseError("UNBLOCKED the stream key no longer exists"),
        _db(OperationalError, psycopg.errors.SerializationFailure("40001")),
        _db(OperationalError, psycopg.errors.DeadlockDetected("40P01")),
        _db(OperationalError, psycopg.errors.AdminShutdown("57P01")),
        _db(OperationalError, psycopg.errors.TooManyConnections("53300")),
        _db(OperationalError, psycopg.errors.LockNotAvailable("55P03")),
        _db(OperationalError, psycopg.OperationalError("connection refused")),
        # Raw, as a connect raises them before SQLAlchemy wraps them.
        psycopg.OperationalError("connection failed: FATAL:  sorry, too many clients already"),
        psycopg.errors.CannotConnectNow("57P03"),
    ],
    ids=repr,
)
def test_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad value"),
        redis.exceptions.ResponseError("WRONGTYPE Operation against a key"),
        _db(DataError, psycopg.errors.NumericValueOutOfRange("22003")),
        _db(IntegrityError, psycopg.errors.UniqueViolation("23505")),
        _db(ProgrammingError, psycopg.errors.UndefinedColumn("42703")),
        psycopg.errors.UndefinedColumn("42703"),
    ],
    ids=repr,
)
def test_not_transient(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_injected_faults_are_transient_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.FAULTS_ENV, "here:2, there")
    monkeypatch.setattr(faults, "_remaining", None)
    for _ in range(2):
        with pytest.raises(OperationalError) as info:
            faults.inject("here")
        assert is_transient(info.value)
    faults.inject("here")  # used up
    with pytest.raises(OperationalError):
        faults.inject("there")
    faults.inject("elsewhere")


def test_no_faults_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    monkeypatch.setattr(faults, "_remaining", None)
    faults.inject("anywhere")
