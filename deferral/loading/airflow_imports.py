"""Airflow's import paths for unmodified DAG files (``DEFERRAL_AIRFLOW_IMPORTS=true``).

While the DagBag imports a DAG file (``active()``), a finder first on ``sys.meta_path`` answers
``airflow`` and its modules listed in ``ALIASES`` (Airflow 2.10's paths, and Airflow 3's
``airflow.sdk`` / ``airflow.providers.standard`` names of what deferral implements) with
modules that hand out deferral's objects themselves: ``airflow.operators.bash.BashOperator``
*is* ``deferral.operators.bash.BashOperator``, so classpaths, pickling and ``isinstance`` are
deferral's. A name deferral lacks fails the import with "airflow.X.Y is not supported by
deferral" (the DagBag adds the DAG file's line). The ``airflow`` modules are forgotten again
after the file is loaded: outside DAG files ``import airflow`` is what it would be without
deferral. If a real ``airflow`` package is importable, the finder refuses every ``airflow``
import, saying so, instead of standing in for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

ROOT = "airflow"


@dataclass(frozen=True)
class Alias:
    """An ``airflow`` module: the public names of ``module`` (if any), plus ``names`` (the
    Airflow name -> ``"deferral.module:name"``), which take precedence."""

    module: str | None = None
    names: Mapping[str, str] = field(default_factory=dict)


def _names(module: str, *names: str) -> dict[str, str]:
    return {name: f"{module}:{name}" for name in names}


_EXCEPTIONS = {
    "AirflowException": "deferral.exceptions:DeferralException",
    "AirflowSkipException": "deferral.exceptions:SkipTask",
    "AirflowFailException": "deferral.exceptions:FailTask",
    "AirflowSensorTimeout": "deferral.exceptions:SensorTimeout",
    "AirflowRescheduleException": "deferral.exceptions:RescheduleTask",
    "AirflowTaskTimeout": "deferral.exceptions:TaskExecutionTimeout",
    "TaskDeferred": "deferral.exceptions:TaskDeferred",
    "AirflowInactiveAssetInInletOrOutletException": (
        "deferral.exceptions:InactiveAssetInInletOrOutlet"
    ),
    "ParamValidationError": "deferral.models.param:ParamValidationError",
}

# Airflow 3's task SDK: the authoring names in one module.
_SDK = {
    **_names("deferral", "DAG", "dag", "task", "task_group", "TaskGroup", "XComArg"),
    **_names("deferral.decorators", "setup", "teardown"),
    **_names("deferral", "Variable", "Connection", "Context", "chain", "cross_downstream"),
    **_names("deferral.baseoperator", "BaseOperator"),
    **_names("deferral.sensors.base", "BaseSensorOperator", "PokeReturnValue"),
    **_names("deferral.models.param", "Param", "ParamsDict"),
    **_names("deferral.utils.edgemodifier", "Label", "EdgeModifier"),
    **_names("deferral.context", "get_current_context"),
    **_names("deferral.hooks.base", "BaseHook"),
    **_names("deferral.triggers.base", "BaseTrigger", "TriggerEvent"),
    **_names("deferral.trigger_rules", "TriggerRule"),
    **_names(
        "deferral.assets",
        "Asset",
        "AssetAccessControl",
        "AssetAlias",
        "AssetAll",
        "AssetAny",
        "AssetWatcher",
        "Metadata",
    ),
    **_names("deferral.decorators.asset", "asset"),
    **_names("deferral.timetables.trigger", "CronTriggerTimetable"),
    **_names("deferral.timetables.assets", "AssetOrTimeSchedule"),
    **_names(
        "deferral.timetables.partitions",
        "CronPartitionTimetable",
        "PartitionedAssetTimetable",
        "PartitionedAtRuntime",
    ),
    **_names(
        "deferral.partitions",
        "PartitionMapper",
        "IdentityMapper",
        "AllowedKeyMapper",
        "FixedKeyMapper",
        "ProductMapper",
        "ChainMapper",
        "StartOfHourMapper",
        "StartOfDayMapper",
        "StartOfWeekMapper",
        "StartOfMonthMapper",
        "StartOfQuarterMapper",
        "StartOfYearMapper",
        "RollupMapper",
        "FanOutMapper",
        "Window",
        "HourWindow",
        "DayWindow",
        "WeekWindow",
        "MonthWindow",
        "QuarterWindow",
        "YearWindow",
        "SegmentWindow",
        "WaitForAll",
        "MinimumCount",
    ),
}

# ``airflow.providers.common.compat.sdk``: the provider's one module re-exporting Airflow 3's
# SDK names (and Airflow 2's, renamed) for providers that run on both.
_COMPAT_SDK = {
    **_SDK,
    **_EXCEPTIONS,
    **_names("deferral.states", "DagRunState"),
    "TaskInstanceState": "deferral.states:TaskState",
}

_MODELS = {
    **_names("deferral", "DAG", "Variable", "Connection", "XComArg"),
    **_names("deferral.baseoperator", "BaseOperator"),
    **_names("deferral.models.param", "Param", "ParamsDict"),
}

ALIASES: dict[str, Alias] = {
    # Airflow 2.10
    "airflow": Alias(names=_names("deferral", "DAG", "XComArg")),
    "airflow.models": Alias(names=_MODELS),
    "airflow.models.dag": Alias("deferral.models.dag"),
    "airflow.models.baseoperator": Alias("deferral.models.baseoperator"),
    "airflow.models.param": Alias("deferral.models.param"),
    "airflow.models.variable": Alias(names=_names("deferral", "Variable")),
    "airflow.models.connection": Alias(names=_names("deferral", "Connection")),
    "airflow.models.xcom_arg": Alias(names=_names("deferral", "XComArg")),
    "airflow.models.xcom": Alias(names=_names("deferral.models.xcom", "BaseXCom")),
    "airflow.operators": Alias(),
    "airflow.operators.bash": Alias("deferral.operators.bash"),
    "airflow.operators.python": Alias("deferral.operators.python"),
    "airflow.operators.empty": Alias("deferral.operators.empty"),
    "airflow.operators.email": Alias("deferral.operators.email"),
    "airflow.operators.latest_only": Alias("deferral.operators.latest_only"),
    "airflow.operators.branch": Alias("deferral.operators.branch"),
    "airflow.operators.datetime": Alias("deferral.operators.datetime"),
    "airflow.operators.weekday": Alias("deferral.operators.weekday"),
    "airflow.operators.trigger_dagrun": Alias("deferral.operators.trigger_dagrun"),
    "airflow.sensors": Alias(),
    "airflow.sensors.base": Alias("deferral.sensors.base"),
    "airflow.sensors.bash": Alias("deferral.sensors.bash"),
    "airflow.sensors.python": Alias("deferral.sensors.python"),
    "airflow.sensors.date_time": Alias("deferral.sensors.date_time"),
    "airflow.sensors.time_delta": Alias("deferral.sensors.time_delta"),
    "airflow.sensors.time_sensor": Alias("deferral.sensors.time_sensor"),
    "airflow.sensors.weekday": Alias("deferral.sensors.weekday"),
    "airflow.sensors.filesystem": Alias("deferral.sensors.filesystem"),
    "airflow.sensors.external_task": Alias("deferral.sensors.external_task"),
    "airflow.decorators": Alias(
        names={
            **_names("deferral", "dag", "task", "task_group"),
            **_names("deferral.decorators", "setup", "teardown"),
        }
    ),
    "airflow.exceptions": Alias(names=_EXCEPTIONS),
    "airflow.hooks": Alias(),
    "airflow.hooks.base": Alias("deferral.hooks.base"),
    "airflow.macros": Alias("deferral.macros"),
    "airflow.triggers": Alias(),
    "airflow.triggers.base": Alias(
        "deferral.triggers.base", names=_names("deferral.triggers.event", "BaseEventTrigger")
    ),
    "airflow.datasets": Alias(
        names=_names("deferral.assets", "Dataset", "DatasetAlias", "DatasetAll", "DatasetAny")
    ),
    "airflow.triggers.temporal": Alias("deferral.triggers.temporal"),
    "airflow.triggers.file": Alias("deferral.triggers.file"),
    "airflow.triggers.external_task": Alias("deferral.triggers.external_task"),
    "airflow.timetables": Alias(),
    "airflow.timetables.base": Alias("deferral.timetables.base"),
    "airflow.timetables.trigger": Alias(
        names=_names("deferral.timetables.trigger", "CronTriggerTimetable")
    ),
    "airflow.timetables.assets": Alias(
        names=_names("deferral.timetables.assets", "AssetOrTimeSchedule")
    ),
    "airflow.utils": Alias(),
    "airflow.utils.context": Alias(names=_names("deferral.context", "Context")),
    "airflow.utils.dates": Alias("deferral.utils.dates"),
    "airflow.utils.edgemodifier": Alias("deferral.utils.edgemodifier"),
    "airflow.utils.email": Alias("deferral.utils.email"),
    "airflow.utils.helpers": Alias(names=_names("deferral", "chain", "cross_downstream")),
    "airflow.utils.task_group": Alias("deferral.utils.task_group"),
    "airflow.utils.trigger_rule": Alias("deferral.utils.trigger_rule"),
    "airflow.utils.weekday": Alias("deferral.utils.weekday"),
    # Airflow 3
    "airflow.sdk": Alias(names=_SDK),
    "airflow.sdk.exceptions": Alias(names=_EXCEPTIONS),
    "airflow.sdk.execution_time": Alias(),
    "airflow.sdk.execution_time.context": Alias(
        names=_names("deferral.store.seam", "NEVER_EXPIRE")
    ),
    "airflow.sdk.definitions": Alias(),
    "airflow.sdk.definitions.deadline": Alias("deferral.deadline"),
    "airflow.providers": Alias(),
    "airflow.providers.common": Alias(),
    "airflow.providers.common.compat": Alias(),
    "airflow.providers.common.compat.sdk": Alias(names=_COMPAT_SDK),
    "airflow.providers.standard": Alias(),
    "airflow.providers.standard.operators": Alias(),
    "airflow.providers.standard.operators.bash": Alias("deferral.operators.bash"),
    "airflow.providers.standard.operators.python": Alias("deferral.operators.python"),
    "airflow.providers.standard.operators.empty": Alias("deferral.operators.empty"),
    "airflow.providers.standard.operators.latest_only": Alias("deferral.operators.latest_only"),
    "airflow.providers.standard.operators.datetime": Alias("deferral.operators.datetime"),
    "airflow.providers.standard.operators.weekday": Alias("deferral.operators.weekday"),
    "airflow.providers.standard.operators.trigger_dagrun": Alias(
        "deferral.operators.trigger_dagrun"
    ),
    "airflow.providers.standard.operators.hitl": Alias("deferral.operators.hitl"),
    "airflow.providers.standard.exceptions": Alias(
        names=_names("deferral.exceptions", "HITLTimeoutError", "HITLRejectException")
    ),
    "airflow.providers.standard.sensors": Alias(),
    "airflow.providers.standard.sensors.bash": Alias("deferral.sensors.bash"),
    "airflow.providers.standard.sensors.python": Alias("deferral.sensors.python"),
    "airflow.providers.standard.sensors.date_time": Alias("deferral.sensors.date_time"),
    "airflow.providers.standard.sensors.time_delta": Alias("deferral.sensors.time_delta"),
    "airflow.providers.standard.sensors.time": Alias("deferral.sensors.time_sensor"),
    "airflow.providers.standard.sensors.weekday": Alias("deferral.sensors.weekday"),
    "airflow.providers.standard.sensors.filesystem": Alias("deferral.sensors.filesystem"),
    "airflow.providers.standard.sensors.external_task": Alias("deferral.sensors.external_task"),
    "airflow.providers.standard.triggers": Alias(),
    "airflow.providers.standard.triggers.temporal": Alias("deferral.triggers.temporal"),
    "airflow.providers.standard.triggers.file": Alias("deferral.triggers.file"),
    "airflow.providers.standard.triggers.external_task": Alias("deferral.triggers.external_task"),
    "airflow.providers.standard.utils": Alias(),
    "airflow.providers.standard.utils.weekday": Alias("deferral.utils.weekday"),
    "airflow.task": Alias(),
    "airflow.task.priority_strategy": Alias(
        names=_names("deferral.priority_strategy", "PriorityWeightStrategy")
    ),
    # The plugins of Airflow's example DAGs, which import them from Airflow's own package.
    "airflow.example_dags": Alias(),
    "airflow.example_dags.plugins": Alias(),
    "airflow.example_dags.plugins.workday": Alias(
        names=_names("deferral.timetables.workday", "AfterWorkdayTimetable")
    ),
    "airflow.example_dags.plugins.decreasing_priority_weight_strategy": Alias(
        names=_names("deferral.priority_strategy", "DecreasingPriorityStrategy")
    ),
}

# Modules with modules below them are packages (they get a ``__path__``).
_PACKAGES = frozenset(name.rsplit(".", 1)[0] for name in ALIASES if "." in name)


def not_supported(name: str) -> ImportError:
    return ImportError(f"{name} is not supported by deferral", name=name)


class AliasModule(ModuleType):
    """An ``airflow`` module whose attributes are deferral's objects, looked up when read."""

    def __init__(self, name: str, alias: Alias) -> None:
        super().__init__(name)
        self.__alias = alias

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        if full in ALIASES:  # ``from airflow.operators import bash``
            return importlib.import_module(full)
        target = self.__alias.names.get(attr)
        if target is not None:
            module, name = target.split(":")
            return getattr(importlib.import_module(module), name)
        if self.__alias.module is not None and not attr.startswith("_"):
            forwarded = importlib.import_module(self.__alias.module)
            if hasattr(forwarded, attr):
                return getattr(forwarded, attr)
        # ImportError, not AttributeError: ``from airflow.x import Y`` then says this, not
        # Python's own "cannot import name".
        raise not_supported(full)

    def __dir__(self) -> list[str]:
        names = set(self.__alias.names)
        if self.__alias.module is not None:
            forwarded = importlib.import_module(self.__alias.module)
            names |= {n for n in vars(forwarded) if not n.startswith("_")}
        return sorted(names)


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = AliasModule(spec.name, ALIASES[spec.name])
        if spec.name in _PACKAGES:
            module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


class AirflowImportFinder(importlib.abc.MetaPathFinder):
    """Answers ``airflow`` imports with ``ALIASES``; refuses every other ``airflow`` module by
    name, and every one at all if a real ``airflow`` package is importable (``real``)."""

    def __init__(self, real: str | None) -> None:
        self.real = real

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        if self.real is not None:
            raise ImportError(
                f"DEFERRAL_AIRFLOW_IMPORTS is on but a real airflow package is installed "
                f"({self.real}): deferral does not stand in for it; uninstall it or turn "
                "DEFERRAL_AIRFLOW_IMPORTS off",
                name=fullname,
            )
        if fullname not in ALIASES:
            raise not_supported(fullname)
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(), is_package=fullname in _PACKAGES
        )


def real_airflow() -> str | None:
    """Where a real ``airflow`` package is, if one is importable (our finder not counted)."""
    finders = [f for f in sys.meta_path if not isinstance(f, AirflowImportFinder)]
    for finder in finders:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(ROOT, None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec.origin or str(list(spec.submodule_search_locations or []))
    return None


def _forget_airflow_modules() -> None:
    for name in [n for n in sys.modules if n == ROOT or n.startswith(ROOT + ".")]:
        if isinstance(sys.modules[name], AliasModule):
            del sys.modules[name]


@contextmanager
def active() -> Iterator[None]:
    """Airflow's import paths while the block runs (a DagBag importing a DAG file)."""
    finder = AirflowImportFinder(real_airflow())
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        _forget_airflow_modules()
