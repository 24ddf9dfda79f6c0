"""Airflow's custom XCom backend seam (``airflow.models.xcom.BaseXCom``): subclass ``BaseXCom``
and name the class in ``DEFERRAL_XCOM_BACKEND=module.Class``. Task processes then store what
``serialize_value`` returns (tagged JSON, like any XCom: a string, numbers, lists, dicts...) and
give task code what ``deserialize_value`` makes of it: a backend may keep large values elsewhere
(an object store) and store a reference. The web UI and the CLI show what is stored."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

from deferral.runtime.config import ConfigError, xcom_backend


@dataclass(frozen=True)
class StoredXCom:
    """One stored XCom, as ``deserialize_value`` receives it (Airflow passes its XCom row):
    ``value`` is what ``serialize_value`` returned, decoded again."""

    key: str
    value: Any
    dag_id: str
    run_id: str
    task_id: str
    map_index: int


class BaseXCom:
    """The default backend: values are stored as they are. Override both methods (static, as in
    Airflow) and call these for the stored part."""

    @staticmethod
    def serialize_value(
        value: Any,
        *,
        key: str | None = None,
        task_id: str | None = None,
        dag_id: str | None = None,
        run_id: str | None = None,
        map_index: int | None = None,
    ) -> Any:
        return value

    @staticmethod
    def deserialize_value(result: StoredXCom) -> Any:
        return result.value


def resolve_xcom_backend() -> type[BaseXCom]:
    """The class ``DEFERRAL_XCOM_BACKEND`` names (BaseXCom when unset); ConfigError, one line
    naming the setting, if it cannot be imported or is not a BaseXCom subclass."""
    return _load(xcom_backend())


@cache
def _load(path: str | None) -> type[BaseXCom]:
    if path is None:
        return BaseXCom
    module, _, name = path.rpartition(".")
    where = f"DEFERRAL_XCOM_BACKEND={path}"
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: cannot be imported: {type(exc).__name__}: {exc}") from None
    if not isinstance(found, type) or not issubclass(found, BaseXCom):
        raise ConfigError(f"{where}: not a subclass of deferral.models.xcom.BaseXCom")
    return found
