"""deferral.runtime.serialization: exact round trips of the tagged JSON form, and refusals that
name the
key path and the type of the value at fault."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from deferral.runtime import serialization
from deferral.runtime.serialization import TAG, SerializationError


def roundtrip(value: Any) -> Any:
    return serialization.loads(serialization.dumps(value))


# -- datetimes -------------------------------------------------------------------------------------


def test_utc_datetime_round_trips_exactly() -> None:
    moment = dt.datetime(2024, 3, 1, 12, 30, 45, 123456, tzinfo=dt.UTC)
    back = roundtrip(moment)
    assert back == moment
    assert back.utcoffset() == dt.timedelta(0)
    assert back.microsecond == 123456


@pytest.mark.parametrize(
    "offset",
    [
        dt.timedelta(hours=5, minutes=30),
        dt.timedelta(hours=-8),
        dt.timedelta(hours=-3, minutes=-30),
        dt.timedelta(hours=14),
    ],
)
def test_fixed_offset_datetime_keeps_its_offset(offset: dt.timedelta) -> None:
    moment = dt.datetime(2024, 7, 4, 23, 59, 59, 1, tzinfo=dt.timezone(offset))
    back = roundtrip(moment)
    assert back == moment
    assert back.utcoffset() == offset
    # Same wall-clock fields, not merely the same instant.
    assert back.replace(tzinfo=None) == moment.replace(tzinfo=None)


@pytest.mark.parametrize("zone", ["Europe/Paris", "America/New_York", "Asia/Kolkata"])
def test_zoneinfo_datetime_keeps_its_zone(zone: str) -> None:
    moment = dt.datetime(2024, 1, 15, 9, 0, tzinfo=ZoneInfo(zone))
    back = roundtrip(moment)
    assert isinstance(back.tzinfo, ZoneInfo)
    assert back.tzinfo.key == zone
    assert back == moment
    assert back.replace(tzinfo=None) == moment.replace(tzinfo=None)
    # Arithmetic across a DST change must follow the zone, which a fixed offset would not.
    summer = back + dt.timedelta(days=180)
    assert summer.utcoffset() == (moment + dt.timedelta(days=180)).utcoffset()


def test_zoneinfo_ambiguous_time_keeps_fold() -> None:
    # 01:30 happens twice in New York on 2021-11-07; fold=1 is the second (EST, -5h).
    moment = dt.datetime(2021, 11, 7, 1, 30, fold=1, tzinfo=ZoneInfo("America/New_York"))
    back = roundtrip(moment)
    assert back.utcoffset() == dt.timedelta(hours=-5)
    assert back.fold == 1
    assert back.timestamp() == moment.timestamp()


def test_datetime_encoding_is_a_tagged_object() -> None:
    moment = dt.datetime(2024, 1, 1, tzinfo=ZoneInfo("Europe/Paris"))
    assert serialization.to_jsonable(moment) == {
        TAG: "datetime",
        "iso": "2024-01-01T00:00:00+01:00",
        "zone": "Europe/Paris",
    }


def test_unknown_zone_on_load_falls_back_to_the_fixed_offset() -> None:
    data = {TAG: "datetime", "iso": "2024-01-01T00:00:00+03:00", "zone": "Nowhere/Atlantis"}
    back = serialization.from_jsonable(data)
    assert back == dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=3)))
    assert back.utcoffset() == dt.timedelta(hours=3)


# -- timedeltas ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "delta",
    [
        dt.timedelta(0),
        dt.timedelta(microseconds=1),
        dt.timedelta(microseconds=-1),
        dt.timedelta(seconds=-1),
        dt.timedelta(days=-3, hours=4, microseconds=7),
        dt.timedelta(days=400, seconds=86399, microseconds=999999),
        dt.timedelta.max,
        dt.timedelta.min,
    ],
)
def test_timedelta_round_trips_exactly(delta: dt.timedelta) -> None:
    back = roundtrip(delta)
    assert isinstance(back, dt.timedelta)
    assert back == delta
    assert (back.days, back.seconds, back.microseconds) == (
        delta.days,
        delta.seconds,
        delta.microseconds,
    )


# -- containers and scalars ------------------------------------------------------------------------


def test_tuples_nested_in_lists_and_dicts_stay_tuples() -> None:
    value = {
        "pair": (1, "a"),
        "list": [(1, 2), [3, (4, (5,))]],
        "deep": {"x": ({"y": (None,)},)},
        "empty": (),
    }
    back = roundtrip(value)
    assert back == value
    assert isinstance(back["pair"], tuple)
    assert isinstance(back["list"], list)
    assert isinstance(back["list"][0], tuple)
    assert isinstance(back["list"][1][1], tuple)
    assert isinstance(back["list"][1][1][1], tuple)
    assert isinstance(back["deep"]["x"], tuple)
    assert isinstance(back["deep"]["x"][0]["y"], tuple)
    assert back["empty"] == ()
    assert isinstance(back["empty"], tuple)


def test_lists_stay_lists() -> None:
    back = roundtrip([1, [2, 3]])
    assert back == [1, [2, 3]]
    assert type(back) is list
    assert type(back[1]) is list


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, -1, 2**53 + 1, 1.5, -0.25, 1e300, "", "héllo ✓", "a\nb\"c'"],
)
def test_scalars_round_trip_with_their_type(value: Any) -> None:
    back = roundtrip(value)
    assert back == value
    assert type(back) is type(value)


def test_datetimes_and_timedeltas_inside_containers() -> None:
    value = {
        "when": [dt.datetime(2020, 2, 29, tzinfo=dt.UTC)],
        "wait": (dt.timedelta(minutes=-5),),
    }
    assert roundtrip(value) == value


def test_empty_dict_and_plain_nested_dicts() -> None:
    value: dict[str, Any] = {"a": {}, "b": {"c": {"d": [1, {}]}}}
    assert roundtrip(value) == value


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_refused_or_round_trip(value: float) -> None:
    try:
        data = serialization.dumps({"x": value}, "kwargs")
    except SerializationError as exc:
        assert "kwargs['x']" in str(exc)
        return
    back = serialization.loads(data)["x"]
    assert isinstance(back, float)
    assert back == value or (math.isnan(back) and math.isnan(value))


# -- refusals --------------------------------------------------------------------------------------


def test_naive_datetime_refused_naming_key_path() -> None:
    with pytest.raises(SerializationError) as info:
        serialization.check_kwargs({"moment": dt.datetime(2024, 1, 1)}, "trigger kwargs")
    message = str(info.value)
    assert "trigger kwargs['moment']" in message
    assert "naive datetime" in message


def test_naive_datetime_deep_inside_names_full_path() -> None:
    with pytest.raises(SerializationError) as info:
        serialization.check_kwargs({"a": [{"b": (1, dt.datetime(2024, 1, 1))}]}, "kwargs")
    assert "kwargs['a'][0]['b'][1]" in str(info.value)


class Custom:
    pass


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        ({1, 2}, "set"),
        (frozenset({1}), "frozenset"),
        (b"raw", "bytes"),
        (bytearray(b"x"), "bytearray"),
        (object(), "object"),
        (Custom(), f"{__name__}.Custom"),
        (dt.date(2024, 1, 1), "date"),
        (dt.time(12, 0), "time"),
        (1 + 2j, "complex"),
    ],
)
def test_unsupported_types_refused_naming_key_and_type(value: Any, type_name: str) -> None:
    with pytest.raises(SerializationError) as info:
        serialization.check_kwargs({"conn": value}, "trigger kwargs")
    message = str(info.value)
    assert "trigger kwargs['conn']" in message
    assert type_name in message
    assert "\n" not in message


def test_unsupported_type_inside_list_in_dict_names_index() -> None:
    with pytest.raises(SerializationError) as info:
        serialization.to_jsonable({"items": [1, 2, {3}]}, "defer kwargs")
    message = str(info.value)
    assert "defer kwargs['items'][2]" in message
    assert "set" in message


def test_first_bad_key_is_named_not_a_good_one() -> None:
    with pytest.raises(SerializationError) as info:
        serialization.check_kwargs({"good": 1, "bad": object()}, "kwargs")
    assert "kwargs['bad']" in str(info.value)
    assert "kwargs['good']" not in str(info.value)


@pytest.mark.parametrize(("key", "type_name"), [(1, "int"), ((1, 2), "tuple"), (None, "NoneType")])
def test_non_str_dict_keys_refused(key: Any, type_name: str) -> None:
    with pytest.raises(SerializationError) as info:
        serialization.check_kwargs({"outer": {key: "v"}}, "trigger kwargs")
    message = str(info.value)
    assert "trigger kwargs['outer']" in message
    assert type_name in message


def test_reserved_tag_key_refused() -> None:
    with pytest.raises(SerializationError) as info:
        serialization.check_kwargs({"sneaky": {TAG: "datetime", "iso": "x"}}, "kwargs")
    message = str(info.value)
    assert "kwargs['sneaky']" in message
    assert TAG in message


def test_reserved_tag_key_at_top_level_refused() -> None:
    with pytest.raises(SerializationError):
        serialization.dumps({TAG: "tuple", "items": []})


def test_dumps_default_where_is_value() -> None:
    with pytest.raises(SerializationError, match=r"^value has unsupported type set$"):
        serialization.dumps({1})


def test_serialization_error_is_a_value_error() -> None:
    assert issubclass(SerializationError, ValueError)


# -- check_kwargs, dumps/loads, encode ------------------------------------------------------------


def test_check_kwargs_returns_jsonable_form() -> None:
    moment = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    checked = serialization.check_kwargs({"m": moment, "t": (1,), "n": None}, "kwargs")
    assert checked == {
        "m": {TAG: "datetime", "iso": "2024-01-01T00:00:00+00:00"},
        "t": {TAG: "tuple", "items": [1]},
        "n": None,
    }
    assert serialization.from_jsonable(checked) == {"m": moment, "t": (1,), "n": None}


def test_check_kwargs_on_empty_mapping() -> None:
    assert serialization.check_kwargs({}) == {}


def test_encode_sorts_keys_so_equal_values_give_equal_bytes() -> None:
    a = serialization.dumps({"b": 1, "a": {"z": 1, "y": [{"q": 1, "p": 2}]}})
    b = serialization.dumps({"a": {"y": [{"p": 2, "q": 1}], "z": 1}, "b": 1})
    assert a == b
    assert a == b'{"a":{"y":[{"p":2,"q":1}],"z":1},"b":1}'


def test_encode_of_jsonable_is_same_as_dumps() -> None:
    value = {"d": dt.timedelta(seconds=3), "t": ("x",)}
    assert serialization.encode(serialization.to_jsonable(value)) == serialization.dumps(value)


def test_timedelta_wire_form() -> None:
    assert serialization.dumps(dt.timedelta(days=-1, seconds=5, microseconds=6)) == (
        b'{"__deferral_type__":"timedelta","dsu":[-1,5,6]}'
    )


def test_loads_accepts_str_and_bytes() -> None:
    assert serialization.loads('{"a": [1, 2]}') == {"a": [1, 2]}
    assert serialization.loads(b"[true, null]") == [True, None]


@pytest.mark.parametrize("data", [b"", b"{", b"not json", b'{"a": }'])
def test_loads_invalid_json_raises_serialization_error(data: bytes) -> None:
    with pytest.raises(SerializationError, match="not valid JSON"):
        serialization.loads(data)


def test_unknown_tag_on_load_is_refused() -> None:
    with pytest.raises(SerializationError, match="unknown serialized type tag 'bogus'"):
        serialization.loads(b'{"__deferral_type__": "bogus"}')


def test_shown_gives_plain_json_for_logs_and_the_stored_text_if_it_does_not_decode() -> None:
    moment = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    encoded = serialization.dumps({"at": moment, "after": dt.timedelta(seconds=90), "n": (1, 2)})
    assert serialization.shown(encoded) == (
        '{"after":90.0,"at":"2026-01-02T03:04:05+00:00","n":[1,2]}'
    )
    assert "__deferral_type__" not in serialization.shown(encoded)
    assert serialization.shown('{"not json') == '{"not json'
