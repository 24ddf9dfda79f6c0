"""Assets (Airflow 3's name; Airflow 2's ``Dataset``): what a task's ``outlets`` update and a
DAG's ``schedule`` waits for, combined with ``&`` (all) and ``|`` (any), and the watchers whose
event triggers record asset events from outside.

Everything here is authoring and pure evaluation; the tables are ``deferral.models`` and the
writes ``deferral.store.transitions.assets``."""

from __future__ import annotations

import logging
import re
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deferral.runtime.serialization import SerializationError, check_kwargs
from deferral.timetables import NullTimetable
from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of
from deferral.triggers.event import BaseEventTrigger

log = logging.getLogger("deferral")

# Bounds of what a DAG file or an event may carry.
MAX_NAME_LEN = 1000
MAX_WATCHERS_PER_ASSET = 16
MAX_CONDITION_ASSETS = 100
MAX_EVENT_EXTRA_BYTES = 64 * 1024
MAX_DEDUP_KEY_LEN = 250
# The URI schemes of Airflow's own reserved for itself.
_RESERVED_SCHEMES = frozenset({"airflow"})
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f]+$")


class AssetError(ValueError):
    """A bad asset, condition or watcher; the message names it in one line."""


def _check_text(what: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise AssetError(f"asset {what} must be a non-empty string, got {value!r:.80}")
    if len(value) > MAX_NAME_LEN:
        raise AssetError(f"asset {what} {value[:40]!r}... is longer than {MAX_NAME_LEN} characters")
    if not _PRINTABLE.match(value):
        raise AssetError(f"asset {what} {value[:80]!r} holds control characters")
    return value


def _check_uri(uri: str) -> str:
    scheme = _SCHEME.match(uri)
    if scheme and scheme.group(1).lower() in _RESERVED_SCHEMES:
        raise AssetError(f"asset uri {uri[:80]!r}: the scheme {scheme.group(1)!r} is reserved")
    if " " in uri:
        raise AssetError(f"asset uri {uri[:80]!r} holds a space")
    return uri


class BaseAsset:
    """An asset or a condition over assets: ``a & b`` needs both, ``a | b`` either."""

    def __and__(self, other: BaseAsset) -> AssetAll:
        if not isinstance(other, BaseAsset):
            return NotImplemented
        return AssetAll(self, other)

    def __or__(self, other: BaseAsset) -> AssetAny:
        if not isinstance(other, BaseAsset):
            return NotImplemented
        return AssetAny(self, other)

    def evaluate(self, updated: Mapping[str, object] | set[str]) -> bool:
        """Whether the condition holds when the assets named in ``updated`` have queued
        events."""
        raise NotImplementedError

    def iter_assets(self) -> Iterator[Asset]:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class AssetWatcher:
    """Runs ``trigger`` (an event trigger) in the triggerer while a DAG scheduled on the asset is
    active, recording an asset event for each of its events."""

    name: str
    trigger: BaseTrigger

    def __post_init__(self) -> None:
        _check_text("watcher name", self.name)
        if not isinstance(self.trigger, BaseEventTrigger):
            kind = type(self.trigger)
            raise AssetError(
                f"AssetWatcher {self.name!r}: {classpath_of(kind)} is not an event trigger "
                "(a subclass of BaseEventTrigger); only those may watch an asset"
            )
        # Checked now: the scheduler seals these kwargs for the triggerer.
        try:
            check_kwargs(self.trigger.serialize()[1], f"AssetWatcher {self.name!r} kwargs")
        except SerializationError as exc:
            raise AssetError(str(exc)) from None


class Asset(BaseAsset):
    """``Asset(name)``, ``Asset(uri=...)`` or both; a name alone is its uri too, and the other
    way round (as in Airflow 3). Assets are the same when their names are."""

    def __init__(
        self,
        name: str | None = None,
        uri: str | None = None,
        *,
        group: str = "asset",
        extra: dict[str, Any] | None = None,
        watchers: Sequence[AssetWatcher] = (),
    ) -> None:
        if name is None and uri is None:
            raise AssetError("Asset() needs a name or a uri")
        self.name = _check_text("name", name if name is not None else uri)
        self.uri = _check_uri(_check_text("uri", uri if uri is not None else name))
        self.group = _check_text("group", group)
        self.extra = dict(extra or {})
        watchers = list(watchers)
        if len(watchers) > MAX_WATCHERS_PER_ASSET:
            raise AssetError(
                f"asset {self.name!r}: {len(watchers)} watchers, at most {MAX_WATCHERS_PER_ASSET}"
            )
        for watcher in watchers:
            if not isinstance(watcher, AssetWatcher):
                raise AssetError(
                    f"asset {self.name!r}: watchers must be AssetWatcher, got "
                    f"{type(watcher).__name__}"
                )
        names = [w.name for w in watchers]
        if len(set(names)) != len(names):
            raise AssetError(f"asset {self.name!r}: two watchers share a name")
        self.watchers = watchers

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Asset) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("asset", self.name))

    def __repr__(self) -> str:
        return f"Asset(name={self.name!r}, uri={self.uri!r})"

    def evaluate(self, updated: Mapping[str, object] | set[str]) -> bool:
        return self.name in updated

    def iter_assets(self) -> Iterator[Asset]:
        yield self

    def summary(self) -> str:
        return self.name


# Airflow 2's name.
Dataset = Asset


class _AssetBoolean(BaseAsset):
    operator = ""

    def __init__(self, *objects: BaseAsset) -> None:
        for obj in objects:
            if not isinstance(obj, BaseAsset):
                raise AssetError(
                    f"{type(self).__name__} takes assets or conditions, got {type(obj).__name__}"
                )
        if not objects:
            raise AssetError(f"{type(self).__name__}() needs at least one asset")
        self.objects = list(objects)

    def iter_assets(self) -> Iterator[Asset]:
        for obj in self.objects:
            yield from obj.iter_assets()

    def summary(self) -> str:
        parts = [
            f"({o.summary()})"
            if isinstance(o, _AssetBoolean) and len(o.objects) > 1
            else o.summary()
            for o in self.objects
        ]
        return f" {self.operator} ".join(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.objects))})"


class AssetAll(_AssetBoolean):
    """Holds when every one of its assets (or conditions) holds."""

    operator = "&"

    def evaluate(self, updated: Mapping[str, object] | set[str]) -> bool:
        return all(o.evaluate(updated) for o in self.objects)

    def __and__(self, other: BaseAsset) -> AssetAll:
        if not isinstance(other, BaseAsset):
            return NotImplemented
        return AssetAll(*self.objects, other)


class AssetAny(_AssetBoolean):
    """Holds when any one of its assets (or conditions) holds."""

    operator = "|"

    def evaluate(self, updated: Mapping[str, object] | set[str]) -> bool:
        return any(o.evaluate(updated) for o in self.objects)

    def __or__(self, other: BaseAsset) -> AssetAny:
        if not isinstance(other, BaseAsset):
            return NotImplemented
        return AssetAny(*self.objects, other)


DatasetAll = AssetAll
DatasetAny = AssetAny


def is_asset_schedule(schedule: object) -> bool:
    """Whether a DAG's ``schedule`` is assets: one, a condition, or a list of assets."""
    if isinstance(schedule, BaseAsset):
        return True
    return (
        isinstance(schedule, list | tuple)
        and bool(schedule)
        and all(isinstance(s, BaseAsset) for s in schedule)
    )


def asset_condition(where: str, schedule: BaseAsset | Sequence[BaseAsset]) -> BaseAsset:
    """The condition of an asset schedule (a list means all of them, as in Airflow), checked:
    bounded, and one definition per asset name."""
    condition = schedule if isinstance(schedule, BaseAsset) else AssetAll(*schedule)
    assets = list(condition.iter_assets())
    if len(assets) > MAX_CONDITION_ASSETS:
        raise AssetError(
            f"{where}: schedule names {len(assets)} assets, at most {MAX_CONDITION_ASSETS}"
        )
    seen: dict[str, Asset] = {}
    for asset in assets:
        other = seen.setdefault(asset.name, asset)
        if other is not asset and other.uri != asset.uri:
            raise AssetError(f"{where}: asset {asset.name!r} is given two uris")
    return condition


def check_outlets(where: str, outlets: object, what: str = "outlets") -> list[Asset]:
    """A task's ``outlets`` (or ``inlets``, ``what``): assets only (conditions cannot be
    updated or read)."""
    if outlets is None:
        return []
    items = [outlets] if isinstance(outlets, BaseAsset) else outlets
    if not isinstance(items, list | tuple):
        raise AssetError(f"{where}: {what} must be a list of Asset, got {type(outlets).__name__}")
    found: list[Asset] = []
    for item in items:
        if not isinstance(item, Asset):
            raise AssetError(f"{where}: {what} must be Asset, got {type(item).__name__}")
        found.append(item)
    if len(found) > MAX_CONDITION_ASSETS:
        raise AssetError(f"{where}: {len(found)} {what}, at most {MAX_CONDITION_ASSETS}")
    return found


def events_to_consume(
    condition: BaseAsset, queued: Mapping[str, Sequence[int]]
) -> list[int] | None:
    """The ids of the queued events one run consumes (None: the condition does not hold):
    the oldest queued event of each asset of the condition that has one, so each event makes
    one run of a single-asset schedule, and ``a & b`` waits for both."""
    present = {name for name, ids in queued.items() if ids}
    if not condition.evaluate(present):
        return None
    names = {asset.name for asset in condition.iter_assets()}
    return sorted(min(queued[name]) for name in names & present)


def plan_runs(
    condition: BaseAsset, queued: Mapping[str, Sequence[int]], room: int
) -> list[list[int]]:
    """The runs to create now (at most ``room``), each as the event ids it consumes."""
    left = {name: sorted(ids) for name, ids in queued.items()}
    runs: list[list[int]] = []
    while len(runs) < room:
        ids = events_to_consume(condition, left)
        if ids is None:
            break
        runs.append(ids)
        taken = set(ids)
        left = {name: [i for i in got if i not in taken] for name, got in left.items()}
    return runs


@dataclass(frozen=True)
class AssetEvent:
    """One event of ``triggering_asset_events``, as Airflow's context shows it."""

    id: int
    asset: Asset
    extra: dict[str, Any]
    timestamp: Any
    source_dag_id: str | None = None
    source_run_id: str | None = None
    source_task_id: str | None = None
    source_map_index: int = -1
    watcher: str | None = None


@dataclass
class TriggeringAssetEvents(Mapping[Any, list[AssetEvent]]):
    """``context["triggering_asset_events"]``: the asset events that made this run, by asset
    (looked up by an Asset, or by its name)."""

    events: dict[str, list[AssetEvent]] = field(default_factory=dict)

    @staticmethod
    def _key(key: object) -> str:
        return key.name if isinstance(key, Asset) else str(key)

    def __getitem__(self, key: object) -> list[AssetEvent]:
        return self.events[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return self._key(key) in self.events

    def __iter__(self) -> Iterator[str]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)


@dataclass(frozen=True)
class Metadata:
    """Yielded by a task function (Airflow 3's ``airflow.sdk.Metadata``): ``extra`` goes into
    the event the task records for ``asset``, one of its outlets, when it succeeds."""

    asset: Asset
    extra: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.asset, Asset):
            raise AssetError(f"Metadata takes an Asset, got {type(self.asset).__name__}")
        if not isinstance(self.extra, dict):
            raise AssetError(f"Metadata extra must be a dict, got {type(self.extra).__name__}")


@dataclass
class OutletEventAccessor:
    """``context["outlet_events"][asset]``: what the task's event for ``asset`` will carry."""

    asset: Asset
    extra: dict[str, Any] = field(default_factory=dict)


class OutletEventAccessors(Mapping[Any, OutletEventAccessor]):
    """``context["outlet_events"]``: the events the task records for its outlets when it
    succeeds, by outlet (an Asset or its name); setting one's ``extra`` annotates the event."""

    def __init__(self, outlets: Iterable[Asset]) -> None:
        self._outlets = {asset.name: asset for asset in outlets}
        self._accessors: dict[str, OutletEventAccessor] = {}

    def __getitem__(self, key: object) -> OutletEventAccessor:
        name = key.name if isinstance(key, Asset) else key
        if not isinstance(name, str) or name not in self._outlets:
            known = ", ".join(sorted(self._outlets)) or "none"
            raise KeyError(f"{name!r} is not an outlet of this task (outlets: {known})")
        if name not in self._accessors:
            self._accessors[name] = OutletEventAccessor(self._outlets[name])
        return self._accessors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._outlets)

    def __len__(self) -> int:
        return len(self._outlets)

    def extras(self) -> dict[str, dict[str, Any]]:
        """The extras set, by asset name (what the worker records with the success)."""
        return {name: a.extra for name, a in self._accessors.items() if a.extra}


def collect_metadata(
    yielded: Generator[Any, None, Any], outlet_events: OutletEventAccessors
) -> Any:
    """Run a task function that yields: each ``Metadata`` it yields annotates its asset's
    event (anything else is logged and ignored, as Airflow); returns what the function
    returns."""
    while True:
        try:
            item = next(yielded)
        except StopIteration as stop:
            return stop.value
        if isinstance(item, Metadata):
            outlet_events[item.asset].extra.update(item.extra)
        else:
            log.warning("ignoring a %s the task yielded: only Metadata is", type(item).__name__)


def event_from_trigger(event: TriggerEvent) -> tuple[str, dict[str, Any]]:
    """The dedup key and the extra of a watcher's event: an event trigger yields a payload
    ``{"key": ..., **extra}``; the key makes at-least-once delivery record one event."""
    payload = event.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("key"), str):
        raise ValueError("an event trigger's payload must be a dict with a string 'key'")
    key = payload["key"]
    if not key or len(key) > MAX_DEDUP_KEY_LEN:
        raise ValueError(f"event key must be 1 to {MAX_DEDUP_KEY_LEN} characters")
    return key, {k: v for k, v in payload.items() if k != "key"}


class AssetTriggeredTimetable(NullTimetable):
    """The timetable of a DAG scheduled on assets: no run by the clock (the scheduler makes
    runs from asset events); its summary is the condition, as the web UI and the CLI show it."""

    def __init__(self, condition: BaseAsset) -> None:
        self.condition = condition
        self.summary = condition.summary()

    def _serialize(self) -> dict[str, Any] | None:
        # Made again as timetables.serialized.StoredAssetSchedule (no clock).
        return {"type": "asset", "summary": self.summary, "timetable": None}


def watchers_of(condition: BaseAsset | None) -> Iterable[tuple[Asset, AssetWatcher]]:
    if condition is None:
        return []
    return [(asset, w) for asset in condition.iter_assets() for w in asset.watchers]
