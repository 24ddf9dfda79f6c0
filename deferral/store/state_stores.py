"""Airflow 3.3's state stores (AIP-103), in a task's context: ``task_state_store`` (keys of the
task instance, kept across its tries: a job handle a retry reattaches to) and
``asset_state_store`` (keys of an asset, kept across runs: a watermark). Values are JSON
(str, int, float, bool, list, dict); each call is one short transaction of its own, so a key
set before a crash is there for the next try.

A task-state key expires ``retention`` after it was set (``NEVER_EXPIRE``: never; None: after
``DEFAULT_RETENTION``, Airflow's ``[state_store] default_retention_days``); an expired key reads
as absent. Rows go with their task instance (pruned with its run)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.sql import func

from deferral.assets import Asset, AssetAlias
from deferral.store.metastore import metastore
from deferral.store.tables import AssetStateRow, TaskStateRow

#: ``retention=NEVER_EXPIRE``: the key never expires (Airflow's
#: ``airflow.sdk.execution_time.context.NEVER_EXPIRE``).
NEVER_EXPIRE: dt.timedelta = dt.timedelta.max
DEFAULT_RETENTION = dt.timedelta(days=30)
MAX_KEY_LEN = 512
MAX_VALUE_BYTES = 64 * 1024


class StateStoreError(ValueError):
    """A bad key or value for a state store; the message names it."""


def _checked(what: str, key: object, value: Any = None, *, setting: bool = False) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
        raise StateStoreError(
            f"{what}: a key is a string of 1 to {MAX_KEY_LEN} characters, got {key!r:.80}"
        )
    if setting:
        if value is None:
            raise StateStoreError(f"{what}: cannot set {key!r} to None (delete it instead)")
        try:
            size = len(json.dumps(value))
        except (TypeError, ValueError):
            raise StateStoreError(
                f"{what}: the value of {key!r} is not JSON (a {type(value).__name__})"
            ) from None
        if size > MAX_VALUE_BYTES:
            raise StateStoreError(
                f"{what}: the value of {key!r} is {size} bytes, over {MAX_VALUE_BYTES}"
            )
    return key


class TaskStateStore:
    """``context["task_state_store"]``: the keys of this task instance (each map index its
    own), kept across its tries."""

    def __init__(self, task_instance_id: int) -> None:
        self._ti = task_instance_id

    def __repr__(self) -> str:
        return f"<TaskStateStore task_instance_id={self._ti}>"

    def get(self, key: str, default: Any = None) -> Any:
        _checked("task_state_store.get", key)
        with metastore().sessions() as session:
            value = session.scalar(
                select(TaskStateRow.value).where(
                    TaskStateRow.task_instance_id == self._ti,
                    TaskStateRow.key == key,
                    (TaskStateRow.expires_at.is_(None)) | (TaskStateRow.expires_at > func.now()),
                )
            )
        return default if value is None else value

    def set(self, key: str, value: Any, *, retention: dt.timedelta | None = None) -> None:
        _checked("task_state_store.set", key, value, setting=True)
        if retention is not None and not isinstance(retention, dt.timedelta):
            raise StateStoreError(
                f"task_state_store.set: retention must be a timedelta, got {retention!r:.60}"
            )
        keep = DEFAULT_RETENTION if retention is None else retention
        expires_at = None if keep == NEVER_EXPIRE else dt.datetime.now(dt.UTC) + keep
        statement = insert(TaskStateRow).values(
            task_instance_id=self._ti, key=key, value=value, expires_at=expires_at
        )
        with metastore().sessions.begin() as session:
            session.execute(
                statement.on_conflict_do_update(
                    index_elements=[TaskStateRow.task_instance_id, TaskStateRow.key],
                    set_={
                        "value": statement.excluded.value,
                        "expires_at": statement.excluded.expires_at,
                        "updated_at": func.now(),
                    },
                )
            )

    def delete(self, key: str) -> None:
        _checked("task_state_store.delete", key)
        with metastore().sessions.begin() as session:
            session.execute(
                delete(TaskStateRow).where(
                    TaskStateRow.task_instance_id == self._ti, TaskStateRow.key == key
                )
            )

    def clear(self) -> None:
        with metastore().sessions.begin() as session:
            session.execute(delete(TaskStateRow).where(TaskStateRow.task_instance_id == self._ti))

    async def aget(self, key: str, default: Any = None) -> Any:
        return await asyncio.to_thread(self.get, key, default)

    async def aset(self, key: str, value: Any, *, retention: dt.timedelta | None = None) -> None:
        await asyncio.to_thread(lambda: self.set(key, value, retention=retention))

    async def adelete(self, key: str) -> None:
        await asyncio.to_thread(self.delete, key)

    async def aclear(self) -> None:
        await asyncio.to_thread(self.clear)


class AssetStateStore:
    """``context["asset_state_store"][asset]``: the keys of one asset, kept across runs."""

    def __init__(self, asset: Asset) -> None:
        self.asset = asset

    def __repr__(self) -> str:
        return f"<AssetStateStore asset={self.asset.name!r}>"

    def get(self, key: str, default: Any = None) -> Any:
        _checked(f"asset_state_store[{self.asset.name!r}].get", key)
        with metastore().sessions() as session:
            value = session.scalar(
                select(AssetStateRow.value).where(
                    AssetStateRow.asset_name == self.asset.name, AssetStateRow.key == key
                )
            )
        return default if value is None else value

    def set(self, key: str, value: Any) -> None:
        _checked(f"asset_state_store[{self.asset.name!r}].set", key, value, setting=True)
        statement = insert(AssetStateRow).values(asset_name=self.asset.name, key=key, value=value)
        with metastore().sessions.begin() as session:
            session.execute(
                statement.on_conflict_do_update(
                    index_elements=[AssetStateRow.asset_name, AssetStateRow.key],
                    set_={"value": statement.excluded.value, "updated_at": func.now()},
                )
            )

    def delete(self, key: str) -> None:
        _checked(f"asset_state_store[{self.asset.name!r}].delete", key)
        with metastore().sessions.begin() as session:
            session.execute(
                delete(AssetStateRow).where(
                    AssetStateRow.asset_name == self.asset.name, AssetStateRow.key == key
                )
            )

    def clear(self) -> None:
        with metastore().sessions.begin() as session:
            session.execute(
                delete(AssetStateRow).where(AssetStateRow.asset_name == self.asset.name)
            )


class AssetStateStores:
    """``context["asset_state_store"]``: the state store of each asset among the task's inlets
    and outlets (by the Asset or its name); with exactly one, ``get``/``set``/``delete``/
    ``clear`` are that one's."""

    def __init__(self, assets: Iterable[Asset | AssetAlias]) -> None:
        self._assets = {a.name: a for a in assets if isinstance(a, Asset)}

    def __getitem__(self, key: object) -> AssetStateStore:
        name = key.name if isinstance(key, Asset) else key
        if not isinstance(name, str) or name not in self._assets:
            known = ", ".join(sorted(self._assets)) or "none"
            raise KeyError(f"{name!r} is not an inlet or outlet of this task (assets: {known})")
        return AssetStateStore(self._assets[name])

    def _only(self) -> AssetStateStore:
        if len(self._assets) != 1:
            raise KeyError(
                f"the task has {len(self._assets)} assets in its inlets and outlets: use "
                "context['asset_state_store'][asset]"
            )
        return AssetStateStore(next(iter(self._assets.values())))

    def get(self, key: str, default: Any = None) -> Any:
        return self._only().get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._only().set(key, value)

    def delete(self, key: str) -> None:
        self._only().delete(key)

    def clear(self) -> None:
        self._only().clear()
