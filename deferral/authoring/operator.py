"""BaseOperator: the unit of work, with ``defer()`` to hand a wait to a trigger. DAG files import
it from its public module, ``deferral.baseoperator``, which also brings in the mapping that
``BaseOperator.partial`` hands on to."""

from __future__ import annotations

import copy
import datetime as dt
import inspect
import itertools
import weakref
from abc import ABCMeta
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from deferral.authoring import setup_teardown
from deferral.authoring.airflow_arguments import (
    TASK_ARGUMENTS,
    TASK_DATES,
    RefusedArgument,
    check_task_arguments,
)
from deferral.authoring.callbacks import CallbackArg, check_callbacks
from deferral.authoring.dependencies import DependencyMixin, is_node_list, relate
from deferral.dag import DAG, check_id
from deferral.exceptions import DagDefinitionError, TaskDeferred, deferral_failure
from deferral.models.param import ParamValidationError, split_params
from deferral.states import FAIL_METHOD
from deferral.timezone import make_aware, standard_timedelta
from deferral.trigger_rules import TriggerRule
from deferral.triggers.base import BaseTrigger
from deferral.triggers.signal import SignalTrigger, check_cancel_on
from deferral.triggers.task_end import StartTriggerArgs, start_trigger
from deferral.utils.task_group import TaskGroup
from deferral.xcom_arg import XComArg, find_runtime_args

if TYPE_CHECKING:
    import jinja2

    from deferral.authoring.mappedoperator import OperatorPartial
    from deferral.context import Context


class _NotSet:
    def __repr__(self) -> str:
        return "NOTSET"


NOTSET: Any = _NotSet()

# Built-in defaults of the arguments that DAG(default_args=...) may set.
_DEFAULTS: dict[str, Any] = {
    "retries": 0,
    "retry_delay": dt.timedelta(minutes=5),
    "execution_timeout": None,
    "trigger_rule": TriggerRule.ALL_SUCCESS,
    "pool": "default_pool",
    "pool_slots": 1,
    "queue": "default",
    "priority_weight": 1,
    "do_xcom_push": True,
    "on_execute_callback": None,
    "on_success_callback": None,
    "on_failure_callback": None,
    "on_retry_callback": None,
    # Waiting on the previous run (scheduler/decide.past_depends_met), as Airflow 2.10.
    "depends_on_past": False,
    "wait_for_downstream": False,
    "ignore_first_depends_on_past": False,
    "wait_for_past_depends_before_skipping": False,
    "on_skipped_callback": None,
}
_PAST_FLAGS = (
    "depends_on_past",
    "wait_for_downstream",
    "ignore_first_depends_on_past",
    "wait_for_past_depends_before_skipping",
)

# What a task holds of its own besides its arguments: what a mapped task's map indexes share.
TASK_SETTINGS = (
    *_DEFAULTS,
    "params",
    "doc",
    "doc_md",
    "doc_rst",
    "doc_json",
    "doc_yaml",
    "is_setup",
    "is_teardown",
    "on_failure_fail_dagrun",
)

_CALLBACKS = (
    "on_execute_callback",
    "on_success_callback",
    "on_failure_callback",
    "on_retry_callback",
    "on_skipped_callback",
)


def _init_names(klass: type) -> tuple[set[str], bool]:
    """The keyword names ``klass.__init__`` (its own) takes, and whether it takes ``**kwargs``."""
    names, open_ended = set(), False
    for parameter in inspect.signature(klass.__dict__["__init__"]).parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            open_ended = True
        elif parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            names.add(parameter.name)
    return names - {"self", "_from_mapped"}, open_ended


# Per class, weakly: a DAG file defines its operator classes anew each time it is re-imported.
_SIGNATURES: weakref.WeakKeyDictionary[type, tuple[frozenset[str], bool]] = (
    weakref.WeakKeyDictionary()
)


def operator_signature(cls: type) -> tuple[frozenset[str], bool]:
    """The arguments an operator class takes by name along its chain of ``__init__``s (an
    ``__init__`` without ``**kwargs`` ends the chain), and whether the chain reaches
    BaseOperator, which also takes Airflow's other task arguments (``TASK_ARGUMENTS``)."""
    known = _SIGNATURES.get(cls)
    if known is None:
        known = _SIGNATURES[cls] = _operator_signature(cls)
    return known


def _operator_signature(cls: type) -> tuple[frozenset[str], bool]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in klass.__dict__ or klass is object:
            continue
        own, open_ended = _init_names(klass)
        names |= own
        if klass is BaseOperator:
            return frozenset(names), True
        if not open_ended:
            break
    return frozenset(names), False


# default_args keys never applied as arguments: BaseOperator merges ``params`` itself.
_NOT_DEFAULTED = frozenset({"task_id", "dag", "task_group", "params"})


def _with_default_args(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus each default_args value (the DAG's, its task groups', the task's own
    ``default_args=``) whose key the operator takes and that is not given, as Airflow applies
    them: operator-specific keys too (a sensor's ``mode``, a Bash ``env``)."""
    own = kwargs.pop("default_args", None)
    if own is not None and not isinstance(own, dict):
        raise DagDefinitionError(
            f"task {kwargs.get('task_id')!r}: default_args must be a dict, got {type(own).__name__}"
        )
    group = kwargs.get("task_group")
    dag = kwargs.get("dag") or (group.dag if group is not None else None) or DAG.current()
    if group is None:
        group = TaskGroup.current(dag)
    defaults = {
        **(dag.default_args if dag is not None else {}),
        **(group.default_args if group is not None else {}),
        **(own or {}),
    }
    if not defaults:
        return kwargs
    names, reaches_base = operator_signature(cls)
    takes = names | TASK_ARGUMENTS if reaches_base else names
    for name in (takes & defaults.keys()) - kwargs.keys() - _NOT_DEFAULTED:
        kwargs[name] = defaults[name]
    return kwargs


def _standard_duration(value: Any) -> Any:
    """A duration argument as a standard timedelta (pendulum's Duration is one of its own);
    any other value is left for the checks (``policies``) to refuse by name."""
    return standard_timedelta(value) if isinstance(value, dt.timedelta) else value


def _seconds(value: Any) -> Any:
    """Airflow 3 takes ``retry_delay`` as a number of seconds too."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return dt.timedelta(seconds=value)
    return value


class _OperatorMeta(ABCMeta):
    """Applies default_args to the arguments the operator takes (``_with_default_args``), and
    calls ``_after_init`` once the outermost ``__init__`` returned, when every subclass has set
    its own arguments (``op_kwargs`` ...). An ABCMeta, so operators may also be ABCs."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        task = super().__call__(*args, **_with_default_args(cls, kwargs))
        task._after_init()
        return task


# Values of these types cannot change: __deepcopy__ shares them instead of asking copy.deepcopy
# (most of an operator's attributes; copying each was most of a copy's time, on every attempt).
_IMMUTABLE_TYPES = frozenset(
    {type(None), bool, int, float, str, bytes, dt.datetime, dt.date, dt.timedelta, TriggerRule}
)


class BaseOperator(DependencyMixin, metaclass=_OperatorMeta):
    """Subclass and implement ``execute(context)``; call ``self.defer(...)`` to wait cheaply."""

    # Attributes rendered as Jinja templates before each attempt (deferral.authoring.templating;
    # XComArgs
    # in them are pulled then), and the endings of values that name a template file rather than
    # hold a template.
    template_fields: Sequence[str] = ()
    template_ext: Sequence[str] = ()

    # Attributes that tie the operator to its DAG; shared, not copied, by __deepcopy__.
    _shallow_attrs: ClassVar[frozenset[str]] = frozenset(
        {"dag", "task_group", "upstream_task_ids", "downstream_task_ids"}
    )
    # Set from the arguments (or default_args) in __init__: a callable, a list of them, or None.
    on_execute_callback: CallbackArg
    on_success_callback: CallbackArg
    on_failure_callback: CallbackArg
    on_retry_callback: CallbackArg
    on_skipped_callback: CallbackArg
    # A MappedOperator (``partial().expand()``) runs once per map index.
    is_mapped: ClassVar[bool] = False
    # Setup and teardown tasks (deferral.authoring.setup_teardown): set by as_setup() /
    # as_teardown().
    is_setup: bool = False
    is_teardown: bool = False
    on_failure_fail_dagrun: bool = False
    # Airflow 2.10's start_from_trigger: once scheduled, the task is deferred to the trigger of
    # start_trigger_args (a StartTriggerArgs) without a worker running execute().
    start_from_trigger: bool = False
    start_trigger_args: StartTriggerArgs | None = None

    def __init__(
        self,
        *,
        task_id: str,
        dag: DAG | None = None,
        retries: int = NOTSET,
        retry_delay: dt.timedelta | float = NOTSET,
        execution_timeout: dt.timedelta | None = NOTSET,
        trigger_rule: str = NOTSET,
        pool: str = NOTSET,
        pool_slots: int = NOTSET,
        queue: str = NOTSET,
        priority_weight: int = NOTSET,
        params: dict[str, Any] | None = None,
        task_group: TaskGroup | None = None,
        do_xcom_push: bool = NOTSET,
        multiple_outputs: bool = False,
        post_execute: Callable[[Context, Any], Any] | None = None,
        on_execute_callback: CallbackArg = NOTSET,
        on_success_callback: CallbackArg = NOTSET,
        on_failure_callback: CallbackArg = NOTSET,
        on_retry_callback: CallbackArg = NOTSET,
        depends_on_past: bool = NOTSET,
        wait_for_downstream: bool = NOTSET,
        ignore_first_depends_on_past: bool = NOTSET,
        wait_for_past_depends_before_skipping: bool = NOTSET,
        on_skipped_callback: CallbackArg = NOTSET,
        doc: str | None = None,
        doc_md: str | None = None,
        doc_rst: str | None = None,
        doc_json: str | None = None,
        doc_yaml: str | None = None,
        _from_mapped: bool = False,
        **unknown: Any,
    ) -> None:
        label = check_id("task_id", task_id)
        self.dag = dag or (task_group.dag if task_group is not None else None) or DAG.current()
        if unknown:
            self._airflow_arguments(task_id, unknown)
        group = task_group if task_group is not None else TaskGroup.current(self.dag)
        if group is not None and group.dag is not self.dag:
            raise DagDefinitionError(
                f"task {task_id!r} and its task group {group.group_id!r} are not in the same DAG"
            )
        self.task_group = group
        # In a group the id carries the group's id: "group.task".
        self.task_id = check_id("task_id", group.child_id(label)) if group else label
        task_id = self.task_id
        given: dict[str, Any] = {
            "retries": retries,
            "retry_delay": retry_delay,
            "execution_timeout": execution_timeout,
            "trigger_rule": trigger_rule,
            "pool": pool,
            "pool_slots": pool_slots,
            "queue": queue,
            "priority_weight": priority_weight,
            "do_xcom_push": do_xcom_push,
            "on_execute_callback": on_execute_callback,
            "on_success_callback": on_success_callback,
            "on_failure_callback": on_failure_callback,
            "on_retry_callback": on_retry_callback,
            "depends_on_past": depends_on_past,
            "wait_for_downstream": wait_for_downstream,
            "ignore_first_depends_on_past": ignore_first_depends_on_past,
            "wait_for_past_depends_before_skipping": wait_for_past_depends_before_skipping,
            "on_skipped_callback": on_skipped_callback,
        }
        # A task group's default_args apply over the DAG's.
        defaults = {
            **(self.dag.default_args if self.dag else {}),
            **(group.default_args if group else {}),
        }
        resolved: dict[str, Any] = {
            name: value if value is not NOTSET else defaults.get(name, _DEFAULTS[name])
            for name, value in given.items()
        }
        self.retries: int = resolved["retries"]
        self.retry_delay: dt.timedelta = _standard_duration(_seconds(resolved["retry_delay"]))
        self.execution_timeout: dt.timedelta | None = _standard_duration(
            resolved["execution_timeout"]
        )
        self.pool: str = resolved["pool"]
        self.pool_slots: int = resolved["pool_slots"]
        self.queue: str = check_id("queue", resolved["queue"])
        self.priority_weight: int = resolved["priority_weight"]
        self.do_xcom_push: bool = bool(resolved["do_xcom_push"])
        # As Airflow: a returned dict is also pushed key by key (the worker does it).
        self.multiple_outputs: bool = bool(multiple_outputs)
        if post_execute is not None and not callable(post_execute):
            raise DagDefinitionError(
                f"task {task_id!r}: post_execute must be callable, got {post_execute!r:.60}"
            )
        self._post_execute_hook = post_execute
        for name in _CALLBACKS:
            setattr(self, name, check_callbacks(f"task {task_id!r}", name, resolved[name]))
        for name in _PAST_FLAGS:
            if not isinstance(resolved[name], bool):
                raise DagDefinitionError(
                    f"task {task_id!r}: {name} must be True or False, got {resolved[name]!r}"
                )
        self.wait_for_downstream: bool = resolved["wait_for_downstream"]
        # As in Airflow, waiting for the previous run's downstream tasks implies waiting for it.
        self.depends_on_past: bool = resolved["depends_on_past"] or self.wait_for_downstream
        self.ignore_first_depends_on_past: bool = resolved["ignore_first_depends_on_past"]
        self.wait_for_past_depends_before_skipping: bool = resolved[
            "wait_for_past_depends_before_skipping"
        ]
        self.doc, self.doc_md, self.doc_rst = doc, doc_md, doc_rst
        self.doc_json, self.doc_yaml = doc_json, doc_yaml
        try:
            self.trigger_rule = TriggerRule(resolved["trigger_rule"])
        except ValueError:
            raise DagDefinitionError(
                f"task {task_id!r}: unknown trigger_rule {resolved['trigger_rule']!r}"
            ) from None
        if not isinstance(self.retries, int) or self.retries < 0:
            raise DagDefinitionError(f"task {task_id!r}: retries must be an int >= 0")
        if params is not None and not isinstance(params, Mapping):
            raise DagDefinitionError(f"task {task_id!r}: params must be a dict")
        try:
            own_params = split_params(params or {})[0]
        except ParamValidationError as exc:
            raise DagDefinitionError(f"task {task_id!r}: {exc}") from None
        # ``params`` in templates and the context: the DAG's, default_args', then the task's own.
        self.params: dict[str, Any] = {
            **(self.dag.params if self.dag else {}),
            **defaults.get("params", {}),
            **own_params,
        }
        self.upstream_task_ids: set[str] = set()
        self.downstream_task_ids: set[str] = set()
        if _from_mapped:
            return  # one map index's operator, built per attempt: the DAG has its mapped task
        if self.dag is not None:
            self.dag.add_task(self)
            setup_teardown.record(self)
        if group is not None:
            group.add(self)

    def _airflow_arguments(self, task_id: str, given: dict[str, Any]) -> None:
        """Keep Airflow's descriptive arguments and those given a value under which Airflow does
        nothing either; refuse, naming it, any other (``deferral.authoring.airflow_arguments``)."""
        dag_dates = {
            "start_date": self.dag.start_date if self.dag else None,
            "end_date": self.dag.end_date if self.dag else None,
        }
        dates = {
            name: make_aware(value) if isinstance(value, dt.datetime) else value
            for name, value in given.items()
            if name in TASK_DATES
        }
        try:
            kept = check_task_arguments(f"task {task_id!r}", {**given, **dates}, dag_dates)
        except RefusedArgument as exc:
            raise DagDefinitionError(str(exc)) from None
        for name, value in kept.items():
            setattr(self, name, value)

    def _after_init(self) -> None:
        """XComArgs in the template fields make the tasks they come from upstream of this one."""
        for name in self.template_fields:
            for arg in find_runtime_args(getattr(self, name, None)):
                for upstream in arg.upstream_tasks():
                    relate(upstream, self)

    def __repr__(self) -> str:
        return f"<Task({type(self).__name__}): {self.task_id}>"

    # -- setup and teardown (deferral.authoring.setup_teardown)
    # ---------------------------------------------

    def as_setup(self) -> BaseOperator:
        """Mark this task a setup task; returns it."""
        setup_teardown.mark_setup(self)
        return self

    def as_teardown(
        self, *, setups: Any = None, on_failure_fail_dagrun: bool | None = None
    ) -> BaseOperator:
        """Mark this task a teardown task (of ``setups``, which become setup tasks upstream of
        it); it fails the run when it fails only with ``on_failure_fail_dagrun``. Returns it."""
        setup_teardown.mark_teardown(self, setups, on_failure_fail_dagrun)
        return self

    def __enter__(self) -> BaseOperator:
        """``with setup >> teardown:``: the tasks created inside go between them."""
        setup_teardown.enter_scope(self)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        setup_teardown.exit_scope(wire=exc_type is None)

    @classmethod
    def argument_names(cls) -> tuple[frozenset[str], bool]:
        """The arguments this operator class takes by name, and whether they include
        BaseOperator's (``operator_signature``): what a DAG's default_args may apply to it."""
        return operator_signature(cls)

    # How ``partial()`` makes its OperatorPartial: deferral.authoring.mappedoperator, whose
    # MappedOperator subclasses this class, sets it when imported (the public
    # ``deferral.baseoperator`` imports both), so neither module imports the other.
    _partial_of: ClassVar[Callable[[type[BaseOperator], dict[str, Any]], OperatorPartial]]

    @classmethod
    def partial(cls, **kwargs: Any) -> OperatorPartial:
        """Dynamic task mapping, as Airflow: ``Op.partial(task_id=..., **shared)`` followed by
        ``.expand(arg=[...])`` or ``.expand_kwargs([{...}, ...])`` adds a task that runs once
        per value (see deferral.authoring.mappedoperator)."""
        return BaseOperator._partial_of(cls, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> BaseOperator:
        """A fresh copy for one run: state set on ``self`` during a run never leaks into
        another run or into the resumed instance."""
        cls = type(self)
        fresh = cls.__new__(cls)
        memo[id(self)] = fresh
        for name, value in self.__dict__.items():
            shared = name in self._shallow_attrs or type(value) in _IMMUTABLE_TYPES
            setattr(fresh, name, value if shared else copy.deepcopy(value, memo))
        return fresh

    # -- running -------------------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    def post_execute(self, context: Context, result: Any = None) -> None:
        """Run after ``execute`` returns, before the success is recorded (Airflow's): calls the
        ``post_execute`` argument's hook; a subclass may override it."""
        hook = getattr(self, "_post_execute_hook", None)  # None on a copy made without __init__
        if hook is not None:
            hook(context, result)

    def defer(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: dt.timedelta | None = None,
        cancel_on: SignalTrigger | None = None,
        cancel_state: str = "skipped",
    ) -> NoReturn:
        """Free the worker slot and resume at ``method_name`` when ``trigger`` fires; if a
        signal matching ``cancel_on`` comes first, the task ends ``cancel_state`` (``"skipped"``
        or ``"failed"``) instead, and a running trigger's ``on_kill()`` is called."""
        check_cancel_on(cancel_on, cancel_state)
        raise TaskDeferred(
            trigger=trigger,
            method_name=method_name,
            kwargs=kwargs,
            timeout=timeout,
            cancel_on=cancel_on,
            cancel_state=cancel_state,
        )

    def wait_for_signal(
        self,
        key: str,
        *,
        method_name: str = "execute_complete",
        lookback: dt.timedelta = dt.timedelta(0),
        kwargs: dict[str, Any] | None = None,
        timeout: dt.timedelta | None = None,
    ) -> NoReturn:
        """Free the worker slot and resume at ``method_name`` with ``event`` the payload of the
        next signal sent to ``key`` (or of the latest sent within ``lookback`` before now)."""
        self.defer(
            trigger=SignalTrigger(key, lookback=lookback),
            method_name=method_name,
            kwargs=kwargs,
            timeout=timeout,
        )

    def defer_to_start_trigger(self, args: StartTriggerArgs) -> NoReturn:
        """Defer to ``start_trigger_args`` from a worker: what a try of a start_from_trigger
        task that the scheduler did not defer (a retry woken when due) does first."""
        self.defer(
            trigger=start_trigger(args),
            method_name=args.next_method,
            kwargs=args.next_kwargs,
            timeout=args.timeout,
        )

    def on_kill(self) -> None:
        """Called when the task is cut short by its execution_timeout: stop what ``execute``
        started (a subprocess, an external job). Override as needed."""

    @property
    def output(self) -> XComArg:
        """This task's return value, as an XComArg for other tasks' arguments."""
        return XComArg(self)

    def resume_execution(
        self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context
    ) -> Any:
        """Called (on a fresh instance) when a deferred task resumes: ``next_method`` with the
        event and the defer kwargs, or, when the deferral ended without an event
        (``__fail__``), TaskDeferralTimeout / TaskDeferralError raised here, where a subclass
        may turn it into something else (sensors: SensorTimeout, or skipped with soft_fail)."""
        kwargs = dict(next_kwargs or {})
        if next_method == FAIL_METHOD:
            raise deferral_failure(kwargs)
        event = kwargs.pop("event", None)
        return getattr(self, next_method)(context=context, event=event, **kwargs)

    # -- templating ------------------------------------------------------------------------------

    def get_template_env(self) -> jinja2.Environment:
        """The sandboxed Jinja environment of this task's DAG."""
        from deferral.authoring.templating import template_env

        return template_env(self.dag)

    def render_template_fields(
        self, context: Context, jinja_env: jinja2.Environment | None = None
    ) -> None:
        """Render every attribute named in ``template_fields`` in place (the worker does it on
        each attempt's fresh copy before ``execute``)."""
        from deferral.authoring.templating import render_template_fields

        render_template_fields(self, context, jinja_env)

    def render_template(
        self, content: Any, context: Context, jinja_env: jinja2.Environment | None = None
    ) -> Any:
        """``content`` rendered in ``context``: a string as a template, collections item by item."""
        from deferral.authoring.templating import render_template

        return render_template(self, content, context, jinja_env)

    # -- dependencies --------------------------------------------------------------------------

    def dependency_tasks(self, *, as_upstream: bool) -> list[BaseOperator]:
        return [self]

    def add_downstream_task(self, other: BaseOperator) -> None:
        if other.dag is not self.dag:
            raise DagDefinitionError(
                f"tasks {self.task_id!r} and {other.task_id!r} are not in the same DAG"
            )
        self.downstream_task_ids.add(other.task_id)
        other.upstream_task_ids.add(self.task_id)


def chain(*elements: Any) -> None:
    """``chain(a, [b, c], d)``: a >> [b, c] >> d; two adjacent lists (of equal length) pair up.
    Elements are tasks, XComArgs, task groups, or lists of them."""
    for up, down in itertools.pairwise(elements):
        if is_node_list(up) and is_node_list(down):
            if len(up) != len(down):
                raise DagDefinitionError("chain() got adjacent lists of different lengths")
            for u, d in zip(up, down, strict=True):
                relate(u, d)
        else:
            relate(up, down)


def cross_downstream(from_tasks: Sequence[Any], to_tasks: Any) -> None:
    """Every element of ``from_tasks`` upstream of every element of ``to_tasks``."""
    relate(list(from_tasks), to_tasks)
