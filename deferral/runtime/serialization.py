"""JSON encoding of trigger kwargs, resume kwargs, event payloads and XCom values.

JSON has no tz-aware datetime, timedelta or tuple, and Airflow users pass all three, so those are
written as small tagged objects and restored exactly on the way back. A value of any other type is
refused up front with an error naming where it sits (``kwargs['moment']`` and its type), because a
value that only fails when the triggerer decodes it would fail far from the code that defined it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec

TAG = "__deferral_type__"

# Sorted keys: equal values always encode to equal bytes (events' dedup keys rely on it).
_json_encoder = msgspec.json.Encoder(order="sorted")
_json_decoder = msgspec.json.Decoder()


class SerializationError(ValueError):
    """A value cannot be carried as JSON; the message names where it sits and its type."""


def _type_name(value: object) -> str:
    cls = type(value)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def to_jsonable(value: Any, where: str = "value") -> Any:
    """Turn ``value`` into plain JSON types, tagging datetimes, timedeltas and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SerializationError(f"{where} is {value!r}, which JSON cannot carry")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise SerializationError(f"{where} is a naive datetime; use a tz-aware datetime")
        tagged: dict[str, Any] = {TAG: "datetime", "iso": value.isoformat()}
        if isinstance(value.tzinfo, ZoneInfo):
            tagged["zone"] = value.tzinfo.key
        return tagged
    if isinstance(value, dt.timedelta):
        return {TAG: "timedelta", "dsu": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, tuple):
        return {
            TAG: "tuple",
            "items": [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)],
        }
    if isinstance(value, list):
        return [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise SerializationError(
                    f"{where} has a key of type {_type_name(key)}; keys must be str"
                )
            if key == TAG:
                raise SerializationError(f"{where} uses the reserved key {TAG!r}")
            out[key] = to_jsonable(item, f"{where}[{key!r}]")
        return out
    raise SerializationError(f"{where} has unsupported type {_type_name(value)}")


def from_jsonable(value: Any) -> Any:
    """Inverse of :func:`to_jsonable`; a malformed tagged value raises SerializationError."""
    try:
        return _untag(value)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SerializationError):
            raise
        raise SerializationError(f"malformed serialized value: {exc!r}") from None


def _untag(value: Any) -> Any:
    if isinstance(value, list):
        return [_untag(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(TAG)
    if tag is None:
        return {k: _untag(v) for k, v in value.items()}
    if tag == "datetime":
        moment = dt.datetime.fromisoformat(value["iso"])
        zone = value.get("zone")
        if zone is not None:
            # Unknown zone here: the fixed offset already gives the exact instant.
            with contextlib.suppress(ZoneInfoNotFoundError):
                moment = moment.astimezone(ZoneInfo(zone))
        return moment
    if tag == "timedelta":
        days, seconds, microseconds = value["dsu"]
        return dt.timedelta(days=days, seconds=seconds, microseconds=microseconds)
    if tag == "tuple":
        return tuple(_untag(v) for v in value["items"])
    raise SerializationError(f"unknown serialized type tag {tag!r}")


def check_kwargs(kwargs: dict[str, Any], what: str = "kwargs") -> dict[str, Any]:
    """Validate a kwargs mapping, naming the first key whose value cannot be carried."""
    return {key: to_jsonable(value, f"{what}[{key!r}]") for key, value in kwargs.items()}


def encode(jsonable: Any) -> bytes:
    """Encode a value already in :func:`to_jsonable` form."""
    return _json_encoder.encode(jsonable)


def dumps(value: Any, where: str = "value") -> bytes:
    return encode(to_jsonable(value, where))


def decode(data: bytes | str) -> Any:
    """Inverse of :func:`encode`: the value in :func:`to_jsonable` form (tags kept)."""
    try:
        return _json_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise SerializationError(f"not valid JSON: {exc}") from None


def loads(data: bytes | str) -> Any:
    return from_jsonable(decode(data))


def plain_json(stored: Any) -> Any:
    """A stored value (tagged JSON) as plain JSON, for people to read: datetimes as ISO 8601
    strings, timedeltas as seconds, tuples as arrays. A value that does not decode is given as
    stored."""
    try:
        value = from_jsonable(stored)
    except SerializationError:
        return stored
    return _plain(value)


def shown(encoded: str | bytes) -> str:
    """An encoded value (as :func:`dumps` made it) as plain JSON text, for logs and people."""
    try:
        return msgspec.json.encode(plain_json(msgspec.json.decode(encoded))).decode()
    except (msgspec.DecodeError, msgspec.EncodeError):
        return encoded if isinstance(encoded, str) else encoded.decode(errors="replace")


def _plain(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value
