"""The trigger form built from a DAG's params, as Airflow's trigger page builds it: one field per
param, its kind from the param's JSON-schema ``type`` and ``enum`` (or, for a plain value, its
Python type), its default filled in; and the run's conf read back from the posted fields, each
value parsed as its kind, naming the param at fault. The schema itself is checked at trigger
(``actions.trigger_run``), as for the CLI and the API."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deferral.runtime.secrets_masker import MASK, redact
from deferral.store.serialized_dags import StoredParam
from webserver.inputs import BadInput

FIELD_PREFIX = "param:"
TEXT, INTEGER, NUMBER, BOOLEAN, CHOICE, JSON = (
    "text",
    "integer",
    "number",
    "boolean",
    "choice",
    "json",
)
_SCHEMA_KINDS = {"string": TEXT, "integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN}


@dataclass(frozen=True)
class ParamField:
    name: str
    kind: str
    shown: str  # the default as the field shows it ("" when there is none)
    description: str = ""
    title: str = ""
    choices: list[str] = field(default_factory=list)  # a choice field's values, as JSON text
    required: bool = False  # no default: the run's conf must give it


def shown_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Params' values (by name) as shown anywhere: a secret-looking name's value (``password``,
    ``api_key``, ...) masked whole, secrets this process knows masked inside the others."""
    shown: dict[str, Any] = redact(dict(values))
    return shown


def fields(params: Sequence[StoredParam]) -> list[ParamField]:
    """One field per param, in the DAG's (or the task's) order."""
    made = []
    for param in params:
        kind = _kind(param.schema, param.value)
        made.append(
            ParamField(
                name=param.name,
                kind=kind,
                shown=_shown(kind, param.value) if param.has_value else "",
                description=param.description,
                title=str(param.schema.get("title", "")),
                choices=[json.dumps(choice) for choice in param.schema.get("enum", [])],
                required=not param.has_value,
            )
        )
    return made


def _kind(schema: Mapping[str, Any], value: Any) -> str:
    if "enum" in schema:
        return CHOICE
    declared = schema.get("type")
    if isinstance(declared, str):
        return _SCHEMA_KINDS.get(declared, JSON)
    if declared is not None:  # a list of types: take what is typed as JSON
        return JSON
    if isinstance(value, bool):
        return BOOLEAN
    if isinstance(value, int):
        return INTEGER
    if isinstance(value, float):
        return NUMBER
    return TEXT if isinstance(value, str) else JSON


def _shown(kind: str, value: Any) -> str:
    if kind == CHOICE:
        return json.dumps(value)
    if kind == BOOLEAN:
        return "true" if value else "false"
    if kind == JSON:
        return json.dumps(value, indent=2)
    return "" if value is None else str(value)


def conf_from_form(params: list[ParamField], form: Mapping[str, Any]) -> dict[str, Any]:
    """The conf the posted fields give: a field left at its masked default or left empty is
    left out (the param's default applies); BadInput names a field that does not parse."""
    conf: dict[str, Any] = {}
    for param in params:
        raw = form.get(FIELD_PREFIX + param.name)
        if not isinstance(raw, str) or raw == "" or (raw == MASK and param.shown == MASK):
            continue
        conf[param.name] = _parsed(param, raw)
    return conf


def _parsed(param: ParamField, raw: str) -> Any:
    what = f"param {param.name!r}"
    try:
        if param.kind == INTEGER:
            return int(raw)
        if param.kind == NUMBER:
            return float(raw)
        if param.kind == BOOLEAN:
            if raw not in ("true", "false"):
                raise ValueError(raw)
            return raw == "true"
        if param.kind == CHOICE:
            if raw not in param.choices:
                raise ValueError(raw)
            return json.loads(raw)
        if param.kind == JSON:
            return json.loads(raw)
    except ValueError:
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        raise BadInput(f"{what}: {shown!r} is not a valid {param.kind}") from None
    return raw
