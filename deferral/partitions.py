"""Asset partitions (Airflow 3.2+'s ``airflow.sdk`` partition mappers, windows and wait
policies): what a ``PartitionedAssetTimetable`` says of how an upstream asset's partition keys
map to a downstream DAG's keys.

Authoring and pure mapping only. Each mapper is checked when the DAG file builds it (a bad one
is a one-line error naming it) and maps keys with ``to_downstream``; the scheduler's asset
pass makes a run per mapped key (``deferral.store.transitions.assets.create_partition_runs``)."""

from __future__ import annotations

import datetime as dt
import enum
import re
from collections.abc import Collection, Sequence

from deferral.timetables.trigger import zone

# Airflow's bound on one key (the width of its partition_key columns).
MAX_KEY_LEN = 250
# Airflow's default cap on the downstream keys one upstream key may fan out to.
DEFAULT_MAX_DOWNSTREAM_KEYS = 1000
DEFAULT_INPUT_FORMAT = "%Y-%m-%dT%H:%M:%S"


# What a downstream key's directives read, for formats strptime cannot read back (an ISO week
# with %Y, a quarter): as Airflow's _compile_output_format_regex.
_DIRECTIVES = {"%Y": r"\d{4}", **{f"%{d}": r"\d{2}" for d in "mdHMSVUW"}}


def _decode(key: str, fmt: str, timezone: dt.tzinfo) -> dt.datetime:
    """The moment ``key`` (formatted by ``fmt``) names, naive in ``timezone``."""
    if "{quarter}" not in fmt and "%V" not in fmt:
        try:
            moment = dt.datetime.strptime(key, fmt)
        except ValueError:
            raise ValueError(f"partition key {key!r:.80} does not match {fmt!r}") from None
        if moment.tzinfo is not None:
            moment = moment.astimezone(timezone).replace(tzinfo=None)
        return moment
    parts, i = [], 0
    while i < len(fmt):
        if fmt[i : i + 2] in _DIRECTIVES:
            parts.append(f"(?P<{fmt[i + 1]}>{_DIRECTIVES[fmt[i : i + 2]]})")
            i += 2
        elif fmt.startswith("{quarter}", i):
            parts.append("(?P<quarter>[1-4])")
            i += len("{quarter}")
        else:
            parts.append(re.escape(fmt[i]))
            i += 1
    found = re.fullmatch("".join(parts), key)
    if found is None or "Y" not in found.groupdict():
        raise ValueError(f"partition key {key!r:.80} does not match {fmt!r}")
    fields = {name: int(value) for name, value in found.groupdict().items()}
    month = fields.get("m", 3 * (fields.get("quarter", 1) - 1) + 1)
    return dt.datetime(
        fields["Y"],
        month,
        fields.get("d", 1),
        fields.get("H", 0),
        fields.get("M", 0),
        fields.get("S", 0),
    )


class PartitionError(ValueError):
    """A bad partition mapper, window, key or timetable; the message names it."""


def check_key(key: object, where: str = "partition key") -> str:
    """A partition key as Airflow takes it: a non-blank string of at most 250 characters."""
    if not isinstance(key, str) or not key.strip():
        raise PartitionError(f"{where} must be a non-empty string, got {key!r:.80}")
    if len(key) > MAX_KEY_LEN:
        raise PartitionError(f"{where} {key[:40]!r}... is longer than {MAX_KEY_LEN} characters")
    if "\x00" in key:
        raise PartitionError(f"{where} {key!r:.80} holds a NUL character")
    return key


class PartitionMapper:
    """Maps one upstream partition key to the downstream key(s) it belongs to."""

    def to_downstream(self, key: str) -> str | list[str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _check_mapper(where: str, mapper: object) -> PartitionMapper:
    if not isinstance(mapper, PartitionMapper):
        raise PartitionError(f"{where} must be a PartitionMapper, got {type(mapper).__name__}")
    return mapper


class IdentityMapper(PartitionMapper):
    """The downstream key is the upstream key."""

    def to_downstream(self, key: str) -> str:
        return key


class AllowedKeyMapper(PartitionMapper):
    """The upstream key itself, if it is one of ``allowed_keys`` (else a ValueError: the event
    is not for this DAG)."""

    def __init__(self, allowed_keys: Sequence[str]) -> None:
        if isinstance(allowed_keys, str) or not allowed_keys:
            raise PartitionError("AllowedKeyMapper takes a non-empty list of keys")
        self.allowed_keys = [check_key(k, "AllowedKeyMapper key") for k in allowed_keys]

    def to_downstream(self, key: str) -> str:
        if key not in self.allowed_keys:
            raise ValueError(f"partition key {key!r:.80} is not one of {self.allowed_keys}")
        return key


class FixedKeyMapper(PartitionMapper):
    """Every upstream key maps to the one key ``key``."""

    def __init__(self, key: str) -> None:
        self.key = check_key(key, "FixedKeyMapper key")

    def to_downstream(self, key: str) -> str:
        return self.key


class _StartOfMapper(PartitionMapper):
    """A timestamp key (``input_format``) to the start of the period holding it, formatted by
    ``output_format``."""

    default_output_format = ""

    def __init__(
        self,
        *,
        timezone: str | dt.tzinfo = "UTC",
        input_format: str = DEFAULT_INPUT_FORMAT,
        output_format: str | None = None,
    ) -> None:
        self.timezone = zone(timezone)
        self.input_format = input_format
        self.output_format = output_format or self.default_output_format

    def start_of(self, moment: dt.datetime) -> dt.datetime:
        raise NotImplementedError

    def to_downstream(self, key: str) -> str:
        try:
            moment = dt.datetime.strptime(key, self.input_format)
        except ValueError:
            raise ValueError(
                f"partition key {key!r:.80} does not match {self.input_format!r}"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=self.timezone)
        return self.format(self.start_of(moment.astimezone(self.timezone)))

    def format(self, start: dt.datetime) -> str:
        """A period's start as a downstream key (``output_format``, ``{quarter}`` filled)."""
        quarter = (start.month - 1) // 3 + 1
        return start.strftime(self.output_format.replace("{quarter}", str(quarter)))

    def decode_downstream(self, key: str) -> dt.datetime:
        """The start of the period a downstream key names (naive, in this mapper's timezone):
        the inverse of :meth:`format`, as Airflow's; ValueError naming the key and format."""
        return _decode(key, self.output_format, self.timezone)

    def encode_upstream(self, moment: dt.datetime) -> str:
        """A (naive, this mapper's timezone) moment as the upstream key a producer gives
        (``input_format``)."""
        return moment.replace(tzinfo=self.timezone).strftime(self.input_format)


class StartOfHourMapper(_StartOfMapper):
    default_output_format = "%Y-%m-%dT%H"

    def start_of(self, moment: dt.datetime) -> dt.datetime:
        return moment.replace(minute=0, second=0, microsecond=0)


class StartOfDayMapper(_StartOfMapper):
    default_output_format = "%Y-%m-%d"

    def start_of(self, moment: dt.datetime) -> dt.datetime:
        return moment.replace(hour=0, minute=0, second=0, microsecond=0)


class StartOfWeekMapper(_StartOfMapper):
    default_output_format = "%Y-%m-%d (W%V)"

    def start_of(self, moment: dt.datetime) -> dt.datetime:
        day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        return day - dt.timedelta(days=day.weekday())


class StartOfMonthMapper(_StartOfMapper):
    default_output_format = "%Y-%m"

    def start_of(self, moment: dt.datetime) -> dt.datetime:
        return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


class StartOfQuarterMapper(_StartOfMapper):
    default_output_format = "%Y-Q{quarter}"

    def start_of(self, moment: dt.datetime) -> dt.datetime:
        month = 3 * ((moment.month - 1) // 3) + 1
        return moment.replace(month=month, day=1, hour=0, minute=0, second=0, microsecond=0)


class StartOfYearMapper(_StartOfMapper):
    default_output_format = "%Y"

    def start_of(self, moment: dt.datetime) -> dt.datetime:
        return moment.replace(month=1, day=1, hour=0, minute=0, second=0, microsecond=0)


class ProductMapper(PartitionMapper):
    """A composite key (``a|b``): each part mapped by the mapper in its place."""

    def __init__(self, *mappers: PartitionMapper, delimiter: str = "|") -> None:
        if len(mappers) < 2:
            raise PartitionError("ProductMapper takes at least two mappers")
        self.mappers = [_check_mapper("ProductMapper's mappers", m) for m in mappers]
        if not isinstance(delimiter, str) or not delimiter:
            raise PartitionError("ProductMapper's delimiter must be a non-empty string")
        self.delimiter = delimiter

    def to_downstream(self, key: str) -> str:
        parts = key.split(self.delimiter)
        if len(parts) != len(self.mappers):
            raise ValueError(
                f"partition key {key!r:.80} has {len(parts)} parts, "
                f"ProductMapper maps {len(self.mappers)}"
            )
        mapped = [m.to_downstream(p) for m, p in zip(self.mappers, parts, strict=True)]
        if any(isinstance(m, list) for m in mapped):
            raise ValueError("ProductMapper's mappers must map a key to one key")
        return self.delimiter.join(str(m) for m in mapped)


class ChainMapper(PartitionMapper):
    """The mappers one after the other (each maps the key the previous one gave)."""

    def __init__(self, *mappers: PartitionMapper) -> None:
        if len(mappers) < 2:
            raise PartitionError("ChainMapper takes at least two mappers")
        self.mappers = [_check_mapper("ChainMapper's mappers", m) for m in mappers]

    def to_downstream(self, key: str) -> str:
        for mapper in self.mappers:
            mapped = mapper.to_downstream(key)
            if isinstance(mapped, list):
                raise ValueError("ChainMapper's mappers must map a key to one key")
            key = mapped
        return key


class Window:
    """The members of one period (a rollup waits for them, a fan-out makes one key each), as
    Airflow's: :meth:`members` of the period starting at a (naive) moment, FORWARD from it or,
    BACKWARD, the trailing period ending at it."""

    class Direction(enum.Enum):
        FORWARD = "forward"
        BACKWARD = "backward"

    def __init__(self, direction: Window.Direction = Direction.FORWARD) -> None:
        if not isinstance(direction, Window.Direction):
            raise PartitionError(
                f"{type(self).__name__} direction must be a Window.Direction, got {direction!r}"
            )
        self.direction = direction

    def __repr__(self) -> str:
        return f"{type(self).__name__}(direction={self.direction.name})"

    def members(self, start: dt.datetime) -> list[dt.datetime]:
        raise NotImplementedError


def _shift_months(moment: dt.datetime, months: int) -> dt.datetime:
    total = moment.month - 1 + months
    return moment.replace(year=moment.year + total // 12, month=total % 12 + 1)


class _StepWindow(Window):
    """``count`` members ``step`` apart; BACKWARD ends at the start instead of beginning there."""

    count = 0
    # Month-stepped windows need a period that starts on day 1 (Airflow's _require_day_one).
    by_months = False

    def step(self, moment: dt.datetime, n: int) -> dt.datetime:
        raise NotImplementedError

    def members(self, start: dt.datetime) -> list[dt.datetime]:
        if self.by_months and start.day != 1:
            raise ValueError(
                f"{type(self).__name__} expects a period start on day 1 of the month,"
                f" got {start.isoformat()}"
            )
        first = (
            self.step(start, -(self.count - 1))
            if self.direction is Window.Direction.BACKWARD
            else start
        )
        return [self.step(first, n) for n in range(self.count)]


class HourWindow(_StepWindow):
    """The 60 minutes of an hour."""

    count = 60

    def step(self, moment: dt.datetime, n: int) -> dt.datetime:
        return moment + dt.timedelta(minutes=n)


class DayWindow(_StepWindow):
    """The 24 hours of a day (naive steps: a DST day still has 24)."""

    count = 24

    def step(self, moment: dt.datetime, n: int) -> dt.datetime:
        return moment + dt.timedelta(hours=n)


class WeekWindow(_StepWindow):
    """The 7 days of a week."""

    count = 7

    def step(self, moment: dt.datetime, n: int) -> dt.datetime:
        return moment + dt.timedelta(days=n)


class MonthWindow(Window):
    """The days of a calendar month (28 to 31); BACKWARD, the days after the same day of the
    month before up to the start (Airflow's open-closed trailing month)."""

    def members(self, start: dt.datetime) -> list[dt.datetime]:
        if start.day != 1:
            raise ValueError(
                f"MonthWindow expects a period start on day 1 of the month, got {start.isoformat()}"
            )
        if self.direction is Window.Direction.BACKWARD:
            before = _shift_months(start, -1)
            return [before + dt.timedelta(days=n + 1) for n in range((start - before).days)]
        after = _shift_months(start, 1)
        return [start + dt.timedelta(days=n) for n in range((after - start).days)]


class QuarterWindow(_StepWindow):
    """The 3 months of a quarter."""

    count = 3
    by_months = True

    def step(self, moment: dt.datetime, n: int) -> dt.datetime:
        return _shift_months(moment, n)


class YearWindow(_StepWindow):
    """The 12 months of a year."""

    count = 12
    by_months = True

    def step(self, moment: dt.datetime, n: int) -> dt.datetime:
        return _shift_months(moment, n)


class SegmentWindow(Window):
    """A fixed set of keys (regions, say), not a period of time."""

    def __init__(self, segments: Sequence[str]) -> None:
        super().__init__()
        if isinstance(segments, str) or not segments:
            raise PartitionError("SegmentWindow takes a non-empty list of keys")
        self.segments = [check_key(s, "SegmentWindow key") for s in segments]


def _timed(where: str, window: Window, mapper: PartitionMapper) -> None:
    """A window of time needs an upstream mapper that reads keys as times (a StartOf...Mapper),
    as Airflow refuses the pairing (its RollupMapper at once, its FanOutMapper at the first
    key)."""
    if not isinstance(window, SegmentWindow) and not isinstance(mapper, _StartOfMapper):
        raise PartitionError(
            f"{where}: a {type(window).__name__} needs a StartOf...Mapper upstream_mapper (it"
            f" reads keys as times), got {type(mapper).__name__}"
        )


def _format_with(mapper: PartitionMapper, member: dt.datetime | str) -> str:
    """A fan-out member as a downstream key, as Airflow's ``_format_with``: by a temporal
    mapper's output format, else an ISO timestamp or the segment itself."""
    if isinstance(mapper, _StartOfMapper) and isinstance(member, dt.datetime):
        return mapper.format(member)
    return member.isoformat() if isinstance(member, dt.datetime) else str(member)


class WaitPolicy:
    """When a rollup's downstream run may start, by the members that have arrived."""

    def is_satisfied(self, received: int, expected: int) -> bool:
        raise NotImplementedError


class WaitForAll(WaitPolicy):
    def is_satisfied(self, received: int, expected: int) -> bool:
        return received >= expected

    def __repr__(self) -> str:
        return "WaitForAll()"


class MinimumCount(WaitPolicy):
    """At least ``count`` members (a negative count: at most that many missing)."""

    def __init__(self, count: int) -> None:
        if not isinstance(count, int) or isinstance(count, bool) or count == 0:
            raise PartitionError(f"MinimumCount takes a non-zero int, got {count!r}")
        self.count = count

    def is_satisfied(self, received: int, expected: int) -> bool:
        needed = self.count if self.count > 0 else expected + self.count
        return received >= needed

    def __repr__(self) -> str:
        return f"MinimumCount({self.count})"


def _check_window(where: str, window: object) -> Window:
    if not isinstance(window, Window):
        raise PartitionError(f"{where} window must be a Window, got {type(window).__name__}")
    return window


class RollupMapper(PartitionMapper):
    """Many upstream keys (the members of ``window``) make one downstream key (what
    ``upstream_mapper`` maps each to); the run waits as ``wait_policy`` says, counting the
    keys that arrived among those the window expects (:meth:`to_upstream`)."""

    def __init__(
        self,
        *,
        upstream_mapper: PartitionMapper,
        window: Window,
        wait_policy: WaitPolicy | None = None,
    ) -> None:
        self.upstream_mapper = _check_mapper("RollupMapper upstream_mapper", upstream_mapper)
        self.window = _check_window("RollupMapper", window)
        _timed("RollupMapper", self.window, self.upstream_mapper)
        if wait_policy is not None and not isinstance(wait_policy, WaitPolicy):
            raise PartitionError(
                f"RollupMapper wait_policy must be a WaitPolicy, got {type(wait_policy).__name__}"
            )
        self.wait_policy = wait_policy or WaitForAll()

    def to_downstream(self, key: str) -> str | list[str]:
        if isinstance(self.window, SegmentWindow) and key not in self.window.segments:
            raise ValueError(
                f"partition key {key!r:.80} is not one of the window's segments "
                f"{self.window.segments}"
            )
        return self.upstream_mapper.to_downstream(key)

    def to_upstream(self, downstream_key: str) -> frozenset[str]:
        """The upstream keys the downstream key's window holds, as producers give them: the
        segments, or each member of the period (decoded from the key by the upstream mapper)
        in the upstream mapper's input format."""
        if isinstance(self.window, SegmentWindow):
            return frozenset(self.window.segments)
        mapper = self.upstream_mapper
        assert isinstance(mapper, _StartOfMapper)  # _timed checked it
        start = mapper.decode_downstream(downstream_key)
        return frozenset(mapper.encode_upstream(m) for m in self.window.members(start))

    def complete(self, downstream_key: str, upstream_keys: Collection[str]) -> bool:
        """Whether the downstream key's run may start, with these upstream keys arrived: those
        the window expects, counted by the wait policy; ValueError when the policy can never
        be met by the window (Airflow's unreachable policy: the run is held)."""
        expected = self.to_upstream(downstream_key)
        policy = self.wait_policy
        if isinstance(policy, MinimumCount) and policy.count > len(expected):
            raise ValueError(
                f"wait policy {policy!r} can never be satisfied given the window's cardinality"
                f" {len(expected)}"
            )
        return policy.is_satisfied(len(expected & set(upstream_keys)), len(expected))


# The downstream mapper a fan-out over a window of this kind formats its members with when it
# is given none (as Airflow's table).
_FAN_OUT_DEFAULTS: dict[type[Window], type[_StartOfMapper]] = {
    DayWindow: StartOfHourMapper,
    WeekWindow: StartOfDayMapper,
    MonthWindow: StartOfDayMapper,
    QuarterWindow: StartOfMonthMapper,
    YearWindow: StartOfMonthMapper,
}


class FanOutMapper(PartitionMapper):
    """One upstream key (its period, by ``upstream_mapper``) makes one downstream key per
    member of ``window``, formatted by ``downstream_mapper``; at most ``max_downstream_keys``."""

    def __init__(
        self,
        *,
        upstream_mapper: PartitionMapper,
        window: Window,
        downstream_mapper: PartitionMapper | None = None,
        max_downstream_keys: int | None = None,
    ) -> None:
        self.upstream_mapper = _check_mapper("FanOutMapper upstream_mapper", upstream_mapper)
        self.window = _check_window("FanOutMapper", window)
        _timed("FanOutMapper", self.window, self.upstream_mapper)
        if downstream_mapper is None:
            default = _FAN_OUT_DEFAULTS.get(type(window))
            if default is None:
                raise PartitionError(
                    f"FanOutMapper has no default downstream_mapper for {type(window).__name__}; "
                    "pass downstream_mapper"
                )
            downstream_mapper = default()
        self.downstream_mapper = _check_mapper("FanOutMapper downstream_mapper", downstream_mapper)
        if max_downstream_keys is not None and (
            not isinstance(max_downstream_keys, int) or max_downstream_keys < 1
        ):
            raise PartitionError(
                f"FanOutMapper max_downstream_keys must be a positive int, "
                f"got {max_downstream_keys!r}"
            )
        self.max_downstream_keys = max_downstream_keys or DEFAULT_MAX_DOWNSTREAM_KEYS

    def to_downstream(self, key: str) -> list[str]:
        """As Airflow's: the upstream key's period (by the upstream mapper), each member of the
        window over it formatted by the downstream mapper; a segment window's segments."""
        members: Sequence[dt.datetime | str]
        if isinstance(self.window, SegmentWindow):
            members = self.window.segments
        else:
            mapper = self.upstream_mapper
            assert isinstance(mapper, _StartOfMapper)  # _timed checked it
            members = self.window.members(mapper.decode_downstream(mapper.to_downstream(key)))
        keys = [_format_with(self.downstream_mapper, member) for member in members]
        if len(keys) > self.max_downstream_keys:
            raise ValueError(
                f"partition fan-out of {len(keys)} keys exceeds {self.max_downstream_keys}"
            )
        return keys
