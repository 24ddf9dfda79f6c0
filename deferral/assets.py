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

from deferral.partitions import check_key
from deferral.runtime.serialization import SerializationError, check_kwargs
from deferral.timetables import NullTimetable
from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of
from deferral.triggers.event import BaseEventTrigger

log = logging.getLogger("deferral")

# Bounds of what a DAG file or an event may carry.
MAX_NAME_LEN = 1000
MAX_WATCHERS_PER_ASSET = 16
MAX_CONDITION_ASSETS = 100
# Partition keys one task may add to one outlet (add_partitions): one event each.
MAX_ADDED_PARTITIONS = 1000
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

    def iter_keys(self) -> Iterator[str]:
        """What the condition's queued events are keyed by: its assets' names, and its
        aliases' keys (``AssetAlias.key``)."""
        for asset in self.iter_assets():
            yield asset.name

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


def _check_teams(what: str, teams: object) -> list[str]:
    if isinstance(teams, str) or not isinstance(teams, Iterable):
        raise AssetError(f"AssetAccessControl: {what} must be a list of team names, got {teams!r}")
    names = list(teams)
    for team in names:
        if not isinstance(team, str) or not team.strip():
            raise AssetError(f"AssetAccessControl: each entry in {what} must be a non-empty string")
    return names


@dataclass
class AssetAccessControl:
    """Airflow 3.3's teams of an asset: which teams' producers may update it for its consumers
    (``producer_teams``, and teamless ones if ``allow_global``) and which teams may consume it
    (``consumer_teams``; None: any). Airflow applies it only with ``[core] multi_team`` on;
    deferral is one team, as Airflow is with it off: checked as Airflow checks it, then kept,
    filtering nothing."""

    producer_teams: list[str] = field(default_factory=list)
    consumer_teams: list[str] | None = None
    allow_global: bool = True

    def __post_init__(self) -> None:
        self.producer_teams = _check_teams("producer_teams", self.producer_teams)
        if self.consumer_teams is not None:
            self.consumer_teams = _check_teams("consumer_teams", self.consumer_teams)
        if not isinstance(self.allow_global, bool):
            raise AssetError(
                f"AssetAccessControl: allow_global must be True or False, got {self.allow_global!r}"
            )


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
        access_control: AssetAccessControl | None = None,
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
        if access_control is not None and not isinstance(access_control, AssetAccessControl):
            raise AssetError(
                f"asset {self.name!r}: access_control must be AssetAccessControl, got "
                f"{type(access_control).__name__}"
            )
        self.access_control = access_control or AssetAccessControl()

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

    # A reference (``Asset.ref``) names an asset defined elsewhere: its uri is not known here.
    is_ref = False

    @staticmethod
    def ref(*, name: str = "", uri: str = "") -> Asset:
        """The asset named ``name``, defined elsewhere (deferral knows assets by name, so a
        reference by uri is refused)."""
        if name and uri:
            raise AssetError("Asset.ref takes a name or a uri, not both")
        if uri:
            raise AssetError(
                f"Asset.ref(uri={uri[:80]!r}): deferral knows assets by name; "
                "use Asset.ref(name=...)"
            )
        if not name:
            raise AssetError("Asset.ref needs name=...")
        return AssetNameRef(name)

    def summary(self) -> str:
        return self.name


class AssetNameRef(Asset):
    """``Asset.ref(name=...)``: the asset of that name, whatever its uri."""

    is_ref = True

    def __repr__(self) -> str:
        return f"Asset.ref(name={self.name!r})"


# Airflow 2's name.
Dataset = Asset

# How a DAG scheduled on an alias is recorded among the schedules' asset names.
ALIAS_KEY_PREFIX = "alias:"


class AssetAlias(BaseAsset):
    """``AssetAlias(name)`` (Airflow 3's): assets a task names while it runs. A task with the
    alias in its ``outlets`` adds events of any asset to it
    (``outlet_events[alias].add(asset, extra=...)``); the alias then resolves to those assets.
    A DAG scheduled on the alias runs on each event of an asset it resolves to (none until it
    resolves), and ``inlet_events[alias]`` are the events added through it."""

    def __init__(self, name: str, *, group: str = "asset") -> None:
        self.name = _check_text("alias name", name)
        self.group = _check_text("group", group)

    @property
    def key(self) -> str:
        return ALIAS_KEY_PREFIX + self.name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AssetAlias) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("alias", self.name))

    def __repr__(self) -> str:
        return f"AssetAlias(name={self.name!r})"

    def evaluate(self, updated: Mapping[str, object] | set[str]) -> bool:
        return self.key in updated

    def iter_assets(self) -> Iterator[Asset]:
        return iter(())

    def iter_keys(self) -> Iterator[str]:
        yield self.key

    def summary(self) -> str:
        return self.key


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

    def iter_keys(self) -> Iterator[str]:
        for obj in self.objects:
            yield from obj.iter_keys()

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
DatasetAlias = AssetAlias
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
    named = len(list(condition.iter_keys()))
    if named > MAX_CONDITION_ASSETS:
        raise AssetError(f"{where}: schedule names {named} assets, at most {MAX_CONDITION_ASSETS}")
    seen: dict[str, Asset] = {}
    for asset in assets:
        if asset.is_ref:
            continue
        other = seen.setdefault(asset.name, asset)
        if other is not asset and other.uri != asset.uri:
            raise AssetError(f"{where}: asset {asset.name!r} is given two uris")
    return condition


def check_outlets(where: str, outlets: object, what: str = "outlets") -> list[Asset | AssetAlias]:
    """A task's ``outlets`` (or ``inlets``, ``what``): assets and aliases only (conditions
    cannot be updated or read)."""
    if outlets is None:
        return []
    items = [outlets] if isinstance(outlets, BaseAsset) else outlets
    if not isinstance(items, list | tuple):
        raise AssetError(f"{where}: {what} must be a list of Asset, got {type(outlets).__name__}")
    found: list[Asset | AssetAlias] = []
    for item in items:
        if not isinstance(item, Asset | AssetAlias):
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
    names = set(condition.iter_keys())
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
    the event the task records for ``asset``, one of its outlets, when it succeeds; with
    ``alias`` (an alias among its outlets), into an event of ``asset`` added through it."""

    asset: Asset
    extra: dict[str, Any]
    alias: AssetAlias | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.asset, Asset):
            raise AssetError(f"Metadata takes an Asset, got {type(self.asset).__name__}")
        if not isinstance(self.extra, dict):
            raise AssetError(f"Metadata extra must be a dict, got {type(self.extra).__name__}")
        if self.alias is not None and not isinstance(self.alias, AssetAlias):
            raise AssetError(
                f"Metadata alias must be an AssetAlias, got {type(self.alias).__name__}"
            )


@dataclass
class OutletEventAccessor:
    """``context["outlet_events"][asset]``: what the task's event for ``asset`` will carry."""

    asset: Asset
    extra: dict[str, Any] = field(default_factory=dict)
    # The partition keys the task added (add_partitions), in order.
    partitions: list[str] = field(default_factory=list)

    def add_partitions(self, keys: str | Sequence[str]) -> None:
        """Airflow 3.3's runtime partitions: the task's event for this asset is recorded once
        per key added (instead of once with its run's key), each checked here."""
        listed = [keys] if isinstance(keys, str) else list(keys)
        if not listed:
            raise AssetError(f"add_partitions on {self.asset.name!r} needs at least one key")
        for key in listed:
            check_key(key, f"add_partitions on {self.asset.name!r}: partition key")
            if key not in self.partitions:
                self.partitions.append(key)
        if len(self.partitions) > MAX_ADDED_PARTITIONS:
            raise AssetError(
                f"add_partitions on {self.asset.name!r}: at most {MAX_ADDED_PARTITIONS} keys "
                "per task"
            )


@dataclass
class AliasEventAccessor:
    """``context["outlet_events"][alias]``: the events the task adds through an alias in its
    outlets, each of an asset it names then (``add``), recorded when it succeeds."""

    alias: AssetAlias
    events: list[tuple[Asset, dict[str, Any]]] = field(default_factory=list)

    def add(self, asset: Asset, extra: dict[str, Any] | None = None) -> None:
        if not isinstance(asset, Asset) or asset.is_ref:
            raise AssetError(f"alias {self.alias.name!r}: add takes an Asset, got {asset!r:.80}")
        if extra is not None and not isinstance(extra, dict):
            raise AssetError(
                f"alias {self.alias.name!r}: extra must be a dict, got {type(extra).__name__}"
            )
        if len(self.events) >= MAX_CONDITION_ASSETS:
            raise AssetError(
                f"alias {self.alias.name!r}: at most {MAX_CONDITION_ASSETS} events per task"
            )
        self.events.append((asset, dict(extra or {})))


class OutletEventAccessors(Mapping[Any, Any]):
    """``context["outlet_events"]``: the events the task records for its outlets when it
    succeeds, by outlet (an Asset or its name); setting one's ``extra`` annotates the event.
    An alias among the outlets (looked up by the AssetAlias) takes events of any asset."""

    def __init__(self, outlets: Iterable[Asset | AssetAlias]) -> None:
        outlets = list(outlets)
        self._outlets = {a.name: a for a in outlets if isinstance(a, Asset)}
        self._aliases = {
            a.name: AliasEventAccessor(a) for a in outlets if isinstance(a, AssetAlias)
        }
        self._accessors: dict[str, OutletEventAccessor] = {}

    def __getitem__(self, key: object) -> Any:
        if isinstance(key, AssetAlias):
            if key.name not in self._aliases:
                known = ", ".join(sorted(self._aliases)) or "none"
                raise KeyError(f"{key!r} is not an outlet of this task (aliases: {known})")
            return self._aliases[key.name]
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

    def partitions(self, run_key: str | None) -> dict[str, list[str]]:
        """The partition keys of each outlet's event, by asset name (what the worker records
        with the success): the keys the task added, else its run's key (none: no key)."""
        keys = {name: a.partitions for name, a in self._accessors.items() if a.partitions}
        if run_key is not None:
            keys = {name: keys.get(name, [run_key]) for name in self._outlets}
        return keys

    def alias_events(self) -> list[dict[str, Any]]:
        """The events added through aliases, in order (what the worker records with the
        success): the alias, the asset (name, uri, group) and the extra of each."""
        return [
            {
                "alias": name,
                "name": asset.name,
                "uri": asset.uri,
                "group": asset.group,
                "extra": extra,
            }
            for name, accessor in sorted(self._aliases.items())
            for asset, extra in accessor.events
        ]


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
        if isinstance(item, Metadata) and item.alias is not None:
            outlet_events[item.alias].add(item.asset, extra=item.extra)
        elif isinstance(item, Metadata):
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
