"""Waiting for an asset event: a task resumes when an event of an asset is recorded after it
began to wait (a task with the asset as outlet succeeds, a watcher records one, a task adds one
through an alias)."""

from __future__ import annotations

from typing import Any

from deferral.triggers.base import classpath_of
from deferral.triggers.signal import RowTrigger, SignalError

# The wait row's key of an asset's waiters: '/' is not a signal key's character, so no signal
# sent reaches them.
ASSET_KEY_PREFIX = "asset/"


def asset_key(name: str) -> str:
    """The ``signal_wait`` key the waiters of asset ``name`` hold."""
    return ASSET_KEY_PREFIX + name


def check_asset_name(asset: object) -> str:
    """The name of ``asset`` (an Asset, or its name); SignalError naming it otherwise."""
    name = getattr(asset, "name", asset)
    if not isinstance(name, str) or not name:
        raise SignalError(
            f"asset {asset!r:.60} is invalid: give an Asset or an asset's name (a non-empty string)"
        )
    return name


class AssetEventTrigger(RowTrigger):
    """Resumes the task with the next event of ``asset`` (an Asset, or its name) recorded after
    the task began to wait: ``{"id", "name", "uri", "extra", "timestamp"}``. An event recorded
    before does not count (there is no lookback).

    Nothing runs for it in a triggerer: the wait is a row beside the task's trigger row, and
    the transaction that records an event of the asset resumes its waiters."""

    def __init__(self, asset: Any) -> None:
        super().__init__()
        self.asset = check_asset_name(asset)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(AssetEventTrigger), {"asset": self.asset}


ASSET_TRIGGER = classpath_of(AssetEventTrigger)
