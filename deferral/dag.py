"""DAGs: named graphs of tasks, declared in Python files of the DAGs folder."""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from deferral.assets import AssetTriggeredTimetable, BaseAsset, asset_condition, is_asset_schedule
from deferral.authoring import setup_teardown
from deferral.authoring.airflow_arguments import (
    SLA_DEPRECATION,
    RefusedArgument,
    check_dag_arguments,
    refused_default_args,
)
from deferral.authoring.callbacks import CallbackArg, check_callbacks
from deferral.authoring.markers import StoredMarker, marker_of
from deferral.deadline import DeadlineAlert, deadline_alerts, sla_alert
from deferral.exceptions import DagDefinitionError
from deferral.models.param import ParamValidationError, split_params
from deferral.runtime.config import default_timezone
from deferral.states import DagRunState
from deferral.timetables import (
    CONTINUOUS,
    DagRunInfo,
    DataInterval,
    InvalidSchedule,
    TimeRestriction,
    Timetable,
    UserTimetableError,
    create_timetable,
    is_built_in,
    manual_interval,
    next_info,
)
from deferral.timetables.assets import AssetOrTimeSchedule
from deferral.timetables.partitions import PartitionedAssetTimetable
from deferral.timezone import calendar_delta, make_aware, standard_timedelta
from deferral.xcom_arg import DagParam

log = logging.getLogger("deferral")

if TYPE_CHECKING:
    import jinja2

    from deferral.baseoperator import BaseOperator
    from deferral.utils.task_group import TaskGroup

_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,250}$")


def check_id(kind: str, value: object) -> str:
    if not isinstance(value, str) or not _ID_PATTERN.match(value):
        raise DagDefinitionError(
            f"{kind} {value!r} is invalid: use 1-250 letters, digits, '_', '-' or '.'"
        )
    return value


# "name__3": the suffix TaskFlow calls and task groups get when their id is taken, as in Airflow.
_SUFFIX = re.compile(r"__\d+$")

# (DAG, module whose code created it) for each DAG used as a context manager while a DagBag
# imports a DAG file; None when no DagBag is importing.
_Collected = list[tuple["DAG", str | None]]

_UNSET: Any = object()


def _date_argument(dag_id: str, name: str, value: object) -> dt.datetime | None:
    """A start or end date as given (naive ones read in DEFERRAL_DEFAULT_TIMEZONE)."""
    if value is None:
        return None
    if not isinstance(value, dt.datetime):
        raise DagDefinitionError(
            f"DAG {dag_id!r}: {name} must be a datetime, not {type(value).__name__}"
        )
    return make_aware(value)


def _standard_schedule(schedule: Any) -> Any:
    """A duration schedule in standard types (a pendulum Duration of months: calendar months)."""
    return calendar_delta(schedule) if isinstance(schedule, dt.timedelta) else schedule


# What Airflow 2.10 allows for the descriptive DAG arguments.
DEFAULT_VIEWS = ("grid", "graph", "duration", "gantt", "landing_times")
ORIENTATIONS = ("LR", "TB", "RL", "BT")
_MAX_TAG_LENGTH = 100


def _tags(dag_id: str, tags: object) -> list[str]:
    if tags is None:
        return []
    if isinstance(tags, str) or not isinstance(tags, Iterable):
        raise DagDefinitionError(f"DAG {dag_id!r}: tags must be a list of str")
    found = list(tags)
    for tag in found:
        if not isinstance(tag, str) or not tag or len(tag) > _MAX_TAG_LENGTH:
            raise DagDefinitionError(
                f"DAG {dag_id!r}: tag {tag!r} must be a str of 1-{_MAX_TAG_LENGTH} characters"
            )
    return list(dict.fromkeys(found))


def _owner_links(dag_id: str, links: object) -> dict[str, str]:
    if links is None:
        return {}
    if not isinstance(links, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in links.items()
    ):
        raise DagDefinitionError(f"DAG {dag_id!r}: owner_links must be a dict of owner to link")
    for owner, link in links.items():
        if not link.startswith(("http://", "https://", "mailto:")):
            raise DagDefinitionError(
                f"DAG {dag_id!r}: owner_links[{owner!r}] = {link!r} is not an http(s) or "
                "mailto: link"
            )
    return dict(links)


def _one_of(dag_id: str, name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise DagDefinitionError(
            f"DAG {dag_id!r}: {name} {value!r} is not one of {', '.join(allowed)}"
        )
    return str(value)


class DAG:
    _context_stack: ClassVar[list[DAG]] = []
    _collected: ClassVar[_Collected | None] = None

    def __init__(
        self,
        dag_id: str,
        schedule: Any = _UNSET,
        start_date: dt.datetime | None = None,
        default_args: dict[str, Any] | None = None,
        max_active_tasks: int = 16,
        params: dict[str, Any] | None = None,
        description: str | None = None,
        template_searchpath: str | Iterable[str] | None = None,
        template_undefined: type[jinja2.Undefined] | None = None,
        user_defined_macros: dict[str, Any] | None = None,
        user_defined_filters: dict[str, Callable[..., Any]] | None = None,
        render_template_as_native_obj: bool = False,
        jinja_environment_kwargs: dict[str, Any] | None = None,
        *,
        end_date: dt.datetime | None = None,
        catchup: bool = False,
        max_active_runs: int = 16,
        dagrun_timeout: dt.timedelta | None = None,
        is_paused_upon_creation: bool | None = None,
        schedule_interval: Any = _UNSET,
        doc_md: str | None = None,
        on_success_callback: CallbackArg = None,
        on_failure_callback: CallbackArg = None,
        auto_register: bool = True,
        tags: Iterable[str] | None = None,
        owner_links: dict[str, str] | None = None,
        dag_display_name: str | None = None,
        default_view: str = "grid",
        orientation: str = "LR",
        concurrency: int | None = None,
        full_filepath: str | None = None,
        timetable: Timetable | None = None,
        deadline: DeadlineAlert | Sequence[DeadlineAlert] | None = None,
        sla_miss_callback: Callable[..., Any] | None = None,
        **airflow_arguments: Any,
    ) -> None:
        self.dag_id = check_id("dag_id", dag_id)
        self.defined_at_line = _defining_line()
        try:
            check_dag_arguments(f"DAG {dag_id!r}", airflow_arguments)
        except RefusedArgument as exc:
            raise DagDefinitionError(str(exc)) from None
        if concurrency is not None:  # Airflow 2's deprecated name for max_active_tasks
            warnings.warn(
                "concurrency is deprecated (as in Airflow 2.2+): use max_active_tasks",
                DeprecationWarning,
                stacklevel=2,
            )
            max_active_tasks = concurrency
        # Shown, never acted on (full_filepath has no effect in Airflow 2 either).
        self.tags = _tags(dag_id, tags)
        self.owner_links = _owner_links(dag_id, owner_links)
        self.dag_display_name = dag_display_name or dag_id
        self.default_view = _one_of(dag_id, "default_view", default_view, DEFAULT_VIEWS)
        self.orientation = _one_of(dag_id, "orientation", orientation, ORIENTATIONS)
        self.full_filepath = full_filepath
        self.default_args = dict(default_args or {})
        self.schedule = self._schedule_argument(schedule, schedule_interval, timetable)
        # As in Airflow, default_args may carry the dates for the whole DAG.
        self.start_date = _date_argument(
            dag_id, "start_date", start_date or self.default_args.get("start_date")
        )
        self.end_date = _date_argument(
            dag_id, "end_date", end_date or self.default_args.get("end_date")
        )
        # Cron schedules run in the start date's own zone if it has one, as in Airflow.
        self.timezone: dt.tzinfo = (
            self.start_date.tzinfo
            if self.start_date and self.start_date.tzinfo
            else default_timezone()
        )
        # Assets (deferral.assets): runs made by asset events, not by the clock.
        self.asset_condition: BaseAsset | None = None
        # By the clock and by assets, or by the assets' partitions (a run per key).
        if isinstance(self.schedule, AssetOrTimeSchedule | PartitionedAssetTimetable):
            self.asset_condition = self.schedule.condition
        elif is_asset_schedule(self.schedule):
            self.asset_condition = asset_condition(f"DAG {dag_id!r}", self.schedule)
        try:
            self.timetable: Timetable = (
                AssetTriggeredTimetable(self.asset_condition)
                if self.asset_condition is not None
                and not isinstance(self.schedule, AssetOrTimeSchedule | PartitionedAssetTimetable)
                else create_timetable(self.schedule, self.timezone)
            )
        except InvalidSchedule as exc:
            raise DagDefinitionError(f"DAG {dag_id!r}: {exc}") from None
        self.catchup = catchup
        self.max_active_runs = max_active_runs
        self.dagrun_timeout = (
            standard_timedelta(dagrun_timeout)
            if isinstance(dagrun_timeout, dt.timedelta)
            else dagrun_timeout
        )
        self.is_paused_upon_creation = is_paused_upon_creation
        self._check_schedule_arguments()
        self.max_active_tasks = max_active_tasks
        try:
            # Values for templates and callbacks; the Params, to check a run's conf against.
            self.params, self.param_specs = split_params(params or {})
        except ParamValidationError as exc:
            raise DagDefinitionError(f"DAG {dag_id!r}: {exc}") from None
        self.description = description
        self.doc_md = doc_md
        at = f"DAG {dag_id!r}"
        self.on_success_callback = check_callbacks(at, "on_success_callback", on_success_callback)
        self.on_failure_callback = check_callbacks(at, "on_failure_callback", on_failure_callback)
        self.auto_register = auto_register
        try:
            self.deadline = deadline_alerts(deadline, at)
        except (TypeError, ValueError) as exc:
            raise DagDefinitionError(str(exc)) from None
        if sla_miss_callback is not None:
            warnings.warn(f"{at}: sla_miss_callback: {SLA_DEPRECATION}", DeprecationWarning, 2)
        self.sla_miss_callback = sla_miss_callback
        # Templating (deferral.authoring.templating): where template files are, and the environment.
        if isinstance(template_searchpath, str):
            template_searchpath = [template_searchpath]
        self.template_searchpath: list[str] = list(template_searchpath or [])
        self.template_undefined = template_undefined  # None: jinja2.StrictUndefined
        self.user_defined_macros = dict(user_defined_macros or {})
        self.user_defined_filters = dict(user_defined_filters or {})
        self.render_template_as_native_obj = render_template_as_native_obj
        self.jinja_environment_kwargs = dict(jinja_environment_kwargs or {})
        self.task_dict: dict[str, BaseOperator] = {}
        self.task_group_dict: dict[str, TaskGroup] = {}
        # What labels say about edges: (upstream task id, downstream task id) -> {"label": ...}.
        self.edge_info: dict[tuple[str, str], dict[str, Any]] = {}
        self.fileloc: str | None = None

    def __repr__(self) -> str:
        return f"<DAG {self.dag_id}>"

    # -- schedule ------------------------------------------------------------------------------

    def _schedule_argument(
        self, schedule: Any, schedule_interval: Any, timetable: Timetable | None
    ) -> Any:
        given = {
            name
            for name, value in (
                ("schedule", schedule),
                ("schedule_interval", schedule_interval),
                ("timetable", _UNSET if timetable is None else timetable),
            )
            if value is not _UNSET
        }
        if len(given) > 1:
            raise DagDefinitionError(
                f"DAG {self.dag_id!r}: give one of {', '.join(sorted(given))}, not both"
            )
        if "schedule" in given or not given:
            return None if schedule is _UNSET else _standard_schedule(schedule)
        if timetable is not None and not isinstance(timetable, Timetable):
            raise DagDefinitionError(
                f"DAG {self.dag_id!r}: timetable must be a Timetable, got "
                f"{type(timetable).__name__}"
            )
        # Deprecated in Airflow 2.4+ in favour of schedule, which takes both.
        warnings.warn(
            f"{given.pop()} is deprecated (as in Airflow 2.4+): use schedule",
            DeprecationWarning,
            stacklevel=3,
        )
        return timetable if timetable is not None else _standard_schedule(schedule_interval)

    def _check_schedule_arguments(self) -> None:
        where = f"DAG {self.dag_id!r}"
        if not isinstance(self.catchup, bool):
            raise DagDefinitionError(f"{where}: catchup must be True or False")
        if not isinstance(self.max_active_runs, int) or self.max_active_runs < 1:
            raise DagDefinitionError(f"{where}: max_active_runs must be an int >= 1")
        if self.dagrun_timeout is not None and not isinstance(self.dagrun_timeout, dt.timedelta):
            raise DagDefinitionError(f"{where}: dagrun_timeout must be a timedelta or None")
        if (
            self.timetable.can_be_scheduled
            and self.timetable.needs_start_date
            and self.start_date is None
        ):
            raise DagDefinitionError(f"{where}: schedule {self.schedule!r} needs a start_date")
        if self.end_date and self.start_date and self.end_date < self.start_date:
            raise DagDefinitionError(f"{where}: end_date is before start_date")
        if self.schedule == CONTINUOUS and self.max_active_runs != 1:
            raise DagDefinitionError(f"{where}: schedule '@continuous' needs max_active_runs=1")
        self._check_own_timetable()

    def _check_own_timetable(self) -> None:
        """A DAG file's own timetable is asked once for a first run and a manual interval when
        the DAG loads, so that one that fails refuses its DAG there, naming it, rather than in
        the scheduler."""
        if isinstance(self.schedule, Timetable) and not is_built_in(self.timetable):
            now = dt.datetime.now(dt.UTC)
            try:
                next_info(
                    self.timetable,
                    last_automated_data_interval=None,
                    restriction=self.time_restriction,
                    now=now,
                )
                manual_interval(self.timetable, now)
            except UserTimetableError as exc:
                raise DagDefinitionError(f"DAG {self.dag_id!r}: {exc}") from None

    @property
    def schedule_interval(self) -> Any:
        """Airflow 2's name for ``schedule``."""
        return self.schedule

    @property
    def time_restriction(self) -> TimeRestriction:
        return TimeRestriction(self.start_date, self.end_date, self.catchup)

    def next_dagrun_info(
        self,
        last_automated_data_interval: DataInterval | None,
        *,
        now: dt.datetime,
        restricted: bool = True,
    ) -> DagRunInfo | None:
        """The run the scheduler creates after the latest scheduled or backfill run (None: no
        more runs). ``restricted=False`` ignores start_date, end_date and catchup."""
        restriction = (
            self.time_restriction if restricted else TimeRestriction(None, None, catchup=True)
        )
        try:
            return next_info(
                self.timetable,
                last_automated_data_interval=last_automated_data_interval,
                restriction=restriction,
                now=now,
            )
        except UserTimetableError as exc:
            # The DAG file's own code: this DAG gets no next run, other DAGs are unharmed.
            log.error("DAG %r: no next run: %s", self.dag_id, exc)
            return None

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        """The data interval of a run triggered at ``run_after`` (UserTimetableError, naming
        the class, if the DAG file's own timetable fails)."""
        return manual_interval(self.timetable, run_after)

    def __enter__(self) -> DAG:
        DAG._context_stack.append(self)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        DAG._context_stack.pop()
        if exc_type is None and self.auto_register and DAG._collected is not None:
            DAG._collected.append((self, _defining_module()))

    @classmethod
    def current(cls) -> DAG | None:
        return cls._context_stack[-1] if cls._context_stack else None

    @property
    def tasks(self) -> list[BaseOperator]:
        return list(self.task_dict.values())

    def add_task(self, task: BaseOperator) -> None:
        if task.task_id in self.task_dict and self.task_dict[task.task_id] is not task:
            raise DagDefinitionError(f"DAG {self.dag_id!r} has two tasks with id {task.task_id!r}")
        if task.task_id in self.task_group_dict:
            raise DagDefinitionError(
                f"DAG {self.dag_id!r}: task id {task.task_id!r} is already a task group's id"
            )
        self.task_dict[task.task_id] = task

    def add_task_group(self, group: TaskGroup) -> None:
        group_id = group.group_id
        if group_id in self.task_group_dict:
            raise DagDefinitionError(
                f"DAG {self.dag_id!r} has two task groups with id {group_id!r}"
            )
        if group_id in self.task_dict:
            raise DagDefinitionError(
                f"DAG {self.dag_id!r}: task group id {group_id!r} is already a task's id"
            )
        self.task_group_dict[group_id] = group

    def unique_label(self, label: str, group: TaskGroup | None) -> str:
        """``label``, or ``label__N`` with the next free N if the id it gives in ``group`` is
        taken by a task or a task group (calling a @task twice gives ``name`` and ``name__1``)."""

        def full_id(candidate: str) -> str:
            return group.child_id(candidate) if group is not None else candidate

        taken = self.task_dict.keys() | self.task_group_dict.keys()
        if full_id(label) not in taken:
            return label
        core = _SUFFIX.sub("", label)
        numbered = re.compile(re.escape(full_id(core)) + r"__(\d+)")
        used = [int(match.group(1)) for other in taken if (match := numbered.fullmatch(other))]
        return f"{core}__{max(used, default=0) + 1}"

    def set_edge_info(
        self, upstream_task_id: str, downstream_task_id: str, info: dict[str, Any]
    ) -> None:
        self.edge_info[(upstream_task_id, downstream_task_id)] = dict(info)

    def get_edge_info(self, upstream_task_id: str, downstream_task_id: str) -> dict[str, Any]:
        """What a ``Label`` put on the edge, as Airflow's ``get_edge_info`` (``{}`` if none)."""
        return dict(self.edge_info.get((upstream_task_id, downstream_task_id), {}))

    def param(self, name: str, default: Any) -> DagParam:
        """A reference to the run's ``params[name]``, resolved when a task runs; ``default``
        becomes the DAG's param default (what a @dag function's parameters are)."""
        self.params[name] = default
        return DagParam(self.dag_id, name)

    def doc_md_text(self) -> str | None:
        """``doc_md``; one naming a ``.md`` file next to the DAG file gives that file's text."""
        doc = self.doc_md
        if doc and doc.strip().endswith(".md") and self.fileloc:
            path = Path(self.fileloc).parent / doc.strip()
            if path.is_file():
                return path.read_text(errors="replace")
        return doc

    def get_task(self, task_id: str) -> BaseOperator:
        try:
            return self.task_dict[task_id]
        except KeyError:
            raise DagDefinitionError(f"DAG {self.dag_id!r} has no task {task_id!r}") from None

    def topological_order(self) -> Iterator[BaseOperator]:
        """Tasks upstream first; raises DagDefinitionError naming a task on a cycle."""
        indegree = {tid: len(t.upstream_task_ids) for tid, t in self.task_dict.items()}
        ready = sorted(tid for tid, n in indegree.items() if n == 0)
        seen = 0
        while ready:
            tid = ready.pop(0)
            seen += 1
            yield self.task_dict[tid]
            for down in sorted(self.task_dict[tid].downstream_task_ids):
                indegree[down] -= 1
                if indegree[down] == 0:
                    ready.append(down)
        if seen != len(self.task_dict):
            raise DagDefinitionError(
                f"DAG {self.dag_id!r} has a cycle through {self._task_on_cycle(indegree)!r}"
            )

    def _task_on_cycle(self, indegree: dict[str, int]) -> str:
        """Every unvisited task has an unvisited upstream task, so walking upstream among them
        must come back to a task already passed: that task is on a cycle."""
        unvisited = {tid for tid, n in indegree.items() if n > 0}
        current, passed = min(unvisited), set()
        while current not in passed:
            passed.add(current)
            current = min(self.task_dict[current].upstream_task_ids & unvisited)
        return current

    def deadline_alerts(self) -> list[DeadlineAlert]:
        """The DAG's deadline alerts, with the one its tasks' ``sla`` maps to (Airflow 2)."""
        slas = [
            sla
            for task in self.task_dict.values()
            if isinstance(sla := getattr(task, "sla", None), dt.timedelta)
        ]
        mapped = [sla_alert(slas, self.sla_miss_callback)] if slas else []
        return [*self.deadline, *mapped]

    def marker_of(self, task_id: str) -> StoredMarker | None:
        """What the task ``task_id`` names if it is an ExternalTaskMarker (else None), as the
        DAG's document keeps it."""
        return marker_of(self.get_task(task_id))

    def downstream_of(self, task_id: str) -> set[str]:
        """Every task reachable downstream of ``task_id``."""
        found: set[str] = set()
        pending = [task_id]
        while pending:
            for down in self.get_task(pending.pop()).downstream_task_ids - found:
                found.add(down)
                pending.append(down)
        return found

    def test(
        self,
        execution_date: dt.datetime | None = None,
        run_conf: dict[str, Any] | None = None,
        *,
        logical_date: dt.datetime | None = None,
        **unsupported: Any,
    ) -> DagRunState:
        """Run this DAG once with no service running, as Airflow's ``dag.test()``: for the
        bottom of a DAG file (``if __name__ == "__main__": dag.test()``). The run is
        ``deferral dags test`` on this DAG's file, in a process of its own (the runner uses the
        services' code, which this package does not import): its tasks in dependency order,
        what is ready at once, deferrals included, their state changes and log lines shown.
        Returns the run's final state."""
        if unsupported:
            names = ", ".join(sorted(unsupported))
            raise TypeError(f"DAG.test() does not take {names} (deferral's dags test does not)")
        main = sys.modules.get("__main__")
        fileloc = self.fileloc or getattr(main, "__file__", None)
        if fileloc is None:
            raise RuntimeError(f"DAG.test(): the file that defines DAG {self.dag_id!r} is unknown")
        # -P: the DAG file's folder, where this often runs, may hold a deferral.py.
        command = [sys.executable, "-P", "-m", "deferral", "dags", "test", self.dag_id]
        when = logical_date or execution_date
        if when is not None:
            command.append(make_aware(when).isoformat())
        if run_conf is not None:
            command += ["--conf", json.dumps(run_conf)]
        command += ["--subdir", str(Path(fileloc).resolve())]
        exit_status = subprocess.run(command, check=False).returncode
        if exit_status not in (0, 1):
            raise RuntimeError(f"DAG.test(): `deferral dags test` exited {exit_status}")
        return DagRunState.SUCCESS if exit_status == 0 else DagRunState.FAILED

    def validate(self) -> None:
        for _ in self.topological_order():
            pass
        self._check_default_args()
        setup_teardown.check(self)

    def _check_default_args(self) -> None:
        """Refuse a default_args key Airflow would act on that deferral does not implement
        (``retry_exponential_backoff=True``, ``sla``...) when no task of the DAG takes it as its own
        argument (each task already refused it if it reached one)."""
        taken: set[str] = set()
        for task in self.task_dict.values():
            taken |= getattr(task, "operator_class", type(task)).argument_names()[0]
        for where, defaults in [
            ("default_args", self.default_args),
            *(
                (f"task group {group_id!r} default_args", group.default_args)
                for group_id, group in self.task_group_dict.items()
            ),
        ]:
            refused = refused_default_args(defaults, taken)
            if refused:
                raise DagDefinitionError(
                    f"DAG {self.dag_id!r}: {where}: {refused}", line=self.defined_at_line
                )


def _defining_line() -> int | None:
    """The line of the DAG file (the nearest caller outside deferral) that creates a DAG."""
    frame = sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("deferral."):
        frame = frame.f_back  # type: ignore[assignment]
    return None if frame is None else frame.f_lineno


def _defining_module() -> str | None:
    """The module whose code is creating a DAG: the nearest caller outside deferral itself (the
    @dag factory runs the ``with`` block on its caller's behalf)."""
    frame = sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("deferral."):
        frame = frame.f_back  # type: ignore[assignment]
    return None if frame is None else frame.f_globals.get("__name__")


@contextmanager
def collecting_dags() -> Iterator[_Collected]:
    """Collect the DAGs used as a context manager (``with DAG(...)``, a @dag function's call)
    while the block runs: how a DagBag finds a file's DAGs that no module global holds, as
    Airflow finds them (``auto_register``)."""
    previous = DAG._collected
    collected: _Collected = []
    DAG._collected = collected
    try:
        yield collected
    finally:
        DAG._collected = previous
