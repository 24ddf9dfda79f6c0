"""Jinja templating of operator fields, as Airflow renders ``template_fields``.

Every attribute an operator names in its ``template_fields`` is rendered on the fresh operator
copy of each attempt, in the worker's task process, before ``execute`` or the resume method:
strings are Jinja templates, and lists, tuples, sets and dicts (nested) are rendered item by
item; an object inside them that declares its own ``template_fields`` is rendered in place; an
XComArg or a @dag param becomes its value (pulled now, and not rendered further). A
string ending with one of the operator's ``template_ext`` names a template file, looked up in
the DAG file's folder and the DAG's ``template_searchpath``.

Templates run in Jinja's sandbox (no ``_``-prefixed attribute, no unsafe call) with
``StrictUndefined``: an undefined name fails the task with a line naming the field and the name,
never rendering as an empty string. What each field rendered to is recorded per try, secrets
masked (``rendered_task_instance_fields``), for ``deferral tasks render``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.nativetypes
import jinja2.sandbox
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.runtime.secrets_masker import redact
from deferral.store.seam import RenderedTaskInstanceFields, metastore
from deferral.variables import VariableNotFound
from deferral.xcom_arg import RuntimeArg

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator
    from deferral.context import Context
    from deferral.dag import DAG

# A recorded field longer than this (as JSON) is cut, as Airflow's max_templated_field_length.
MAX_RECORDED_LENGTH = 4096


class TemplateRenderError(Exception):
    """A template field failed to render; the message names the task, the field and why."""


class SandboxedNativeEnvironment(
    jinja2.sandbox.SandboxedEnvironment, jinja2.nativetypes.NativeEnvironment
):
    """For ``render_template_as_native_obj=True``: native Python results, still sandboxed."""


def _date_filter(pattern: str) -> Callable[[Any], str | None]:
    def apply(value: dt.date | None) -> str | None:
        return None if value is None else value.strftime(pattern)

    return apply


def _ts_filter(value: dt.date | None) -> str | None:
    return None if value is None else value.isoformat()


def _ts_nodash_with_tz_filter(value: dt.date | None) -> str | None:
    return None if value is None else value.isoformat().replace("-", "").replace(":", "")


# Airflow's built-in filters: {{ data_interval_end | ds }}.
FILTERS: dict[str, Callable[[Any], str | None]] = {
    "ds": _date_filter("%Y-%m-%d"),
    "ds_nodash": _date_filter("%Y%m%d"),
    "ts": _ts_filter,
    "ts_nodash": _date_filter("%Y%m%dT%H%M%S"),
    "ts_nodash_with_tz": _ts_nodash_with_tz_filter,
}


def template_env(dag: DAG | None) -> jinja2.Environment:
    """The sandboxed environment of ``dag``'s templates, with its macros, filters and options."""
    searchpath: list[str] = []
    if dag is not None and dag.fileloc:
        searchpath.append(os.path.dirname(dag.fileloc))
    native = False
    options: dict[str, Any] = {
        "undefined": jinja2.StrictUndefined,
        "extensions": ["jinja2.ext.do"],
        "cache_size": 0,
    }
    if dag is not None:
        searchpath += [str(path) for path in dag.template_searchpath]
        native = dag.render_template_as_native_obj
        options["undefined"] = dag.template_undefined or jinja2.StrictUndefined
        options.update(dag.jinja_environment_kwargs)
    options["loader"] = jinja2.FileSystemLoader(searchpath)
    env_class = SandboxedNativeEnvironment if native else jinja2.sandbox.SandboxedEnvironment
    env: jinja2.Environment = env_class(**options)
    env.filters.update(FILTERS)
    if dag is not None:
        env.filters.update(dag.user_defined_filters)
        env.globals.update(dag.user_defined_macros)
    return env


def _field_names(task: Any) -> tuple[str, ...]:
    fields = getattr(task, "template_fields", ())
    return (fields,) if isinstance(fields, str) else tuple(fields)


def _why(exc: Exception) -> str:
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"syntax error at line {exc.lineno}: {exc.message}"
    if isinstance(exc, jinja2.TemplateNotFound):
        return f"template file {exc.name!r} not found in the DAG's folder or template_searchpath"
    if isinstance(exc, (jinja2.UndefinedError, jinja2.sandbox.SecurityError, VariableNotFound)):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _Renderer:
    """Renders one task's fields with one environment; ``seen`` guards against cycles."""

    def __init__(self, task: BaseOperator, context: Context, env: jinja2.Environment) -> None:
        self.task = task
        self.context = context
        self.env = env
        self.extensions = tuple(getattr(task, "template_ext", ()) or ())
        self.seen: set[int] = set()

    def fields(self, parent: Any, names: Iterable[str], where: str) -> None:
        for name in names:
            path = f"{where}.{name}" if where else name
            try:
                value = getattr(parent, name)
            except AttributeError:
                raise TemplateRenderError(
                    f"template field {path!r} of task {self.task.task_id!r}: "
                    f"{type(parent).__name__} has no attribute {name!r}"
                ) from None
            try:
                if not value:  # as Airflow: empty values are left as they are
                    continue
            except Exception:  # a value without a truth value (a DataFrame) is rendered
                pass
            if callable(value):  # Airflow 2.8: a callable field renders itself
                try:
                    rendered = value(context=self.context, jinja_env=self.env)
                except Exception as exc:
                    raise self.error(path, exc) from exc
            else:
                rendered = self.value(value, path)
            setattr(parent, name, rendered)

    def error(self, path: str, exc: Exception) -> TemplateRenderError:
        return TemplateRenderError(
            f"template field {path!r} of task {self.task.task_id!r}: {_why(exc)}"
        )

    def value(self, value: Any, path: str) -> Any:
        if id(value) in self.seen:
            return value
        if isinstance(value, RuntimeArg):
            # An XComArg (or a @dag param) becomes its value, which is not rendered, as Airflow.
            try:
                return value.resolve(self.context)
            except Exception as exc:
                raise self.error(path, exc) from exc
        if isinstance(value, str):
            return self.string(value, path)
        if type(value) is tuple:
            return tuple(self.value(item, f"{path}[{i}]") for i, item in enumerate(value))
        if isinstance(value, tuple):  # a named tuple
            return type(value)(*(self.value(item, f"{path}[{i}]") for i, item in enumerate(value)))
        if isinstance(value, list):
            return [self.value(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, dict):
            return {key: self.value(item, f"{path}[{key!r}]") for key, item in value.items()}
        if isinstance(value, (set, frozenset)):
            return type(value)(self.value(item, f"{path}[...]") for item in value)
        names = _field_names(value)
        if names:
            self.seen.add(id(value))
            self.fields(value, names, path)
        return value

    def string(self, text: str, path: str) -> Any:
        try:
            if self.extensions and text.endswith(self.extensions):
                template = self.env.get_template(text)
            else:
                template = self.env.from_string(text)
            rendered = template.render(self.context)
            if isinstance(rendered, jinja2.Undefined):
                # A native environment returns a lone undefined as is; make it fail here.
                rendered = str(rendered)
        except Exception as exc:
            raise self.error(path, exc) from exc
        return rendered


def render_template(
    task: BaseOperator,
    content: Any,
    context: Context,
    env: jinja2.Environment | None = None,
    *,
    where: str = "template",
) -> Any:
    """``content`` rendered in ``context`` (strings, nested collections, objects with
    ``template_fields``); ``content`` itself is left unchanged except for such objects."""
    renderer = _Renderer(task, context, env or template_env(task.dag))
    return renderer.value(content, where)


def render_template_fields(
    task: BaseOperator, context: Context, env: jinja2.Environment | None = None
) -> None:
    """Render every template field of ``task`` in place; TemplateRenderError on the first that
    fails, naming it."""
    _Renderer(task, context, env or template_env(task.dag)).fields(task, _field_names(task), "")


# -- recording what the fields rendered to --------------------------------------------------


def _displayable(value: Any) -> Any:
    """``value`` as JSON for display: containers as lists and objects, other objects as repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(key): _displayable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_displayable(item) for item in value]
    return repr(value)


def rendered_fields(task: BaseOperator) -> dict[str, Any]:
    """Each template field of ``task`` as it is now, as JSON, secrets masked, long ones cut."""
    shown: dict[str, Any] = {}
    for name in _field_names(task):
        value = redact(_displayable(getattr(task, name, None)), name)
        text = json.dumps(value)
        if len(text) > MAX_RECORDED_LENGTH:
            value = f"(cut to {MAX_RECORDED_LENGTH} characters) {text[:MAX_RECORDED_LENGTH]}"
        shown[name] = value
    return shown


def record_rendered_fields(
    session: Session, task_instance_id: int, try_number: int, rendered: dict[str, Any]
) -> None:
    """Store what one try's fields rendered to (a resumed try overwrites its row)."""
    statement = insert(RenderedTaskInstanceFields).values(
        task_instance_id=task_instance_id, try_number=try_number, rendered=rendered
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[
                RenderedTaskInstanceFields.task_instance_id,
                RenderedTaskInstanceFields.try_number,
            ],
            set_={"rendered": statement.excluded.rendered, "rendered_at": dt.datetime.now(dt.UTC)},
        )
    )


def render_and_record(task: BaseOperator, context: Context) -> None:
    """What the worker's task process does before ``execute`` or the resume method: render the
    task's template fields in place, then record them for its try (no row for a task without
    template fields)."""
    if not _field_names(task):
        return
    render_template_fields(task, context)
    rendered = rendered_fields(task)
    ti = context["ti"]
    with metastore().sessions.begin() as session:
        record_rendered_fields(session, ti.id, ti.try_number, rendered)
