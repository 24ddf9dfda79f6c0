"""``Param`` and ``ParamsDict`` (Airflow's ``airflow.models.param``): a DAG's or task's params
with a default, a description and a JSON schema their values must match.

Defaults are checked when the DAG loads, and a manual run's conf when it is triggered (a param
without a default must then be given); task code sees the values (``params["x"]``), never the
``Param``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import jsonschema


class ParamValidationError(ValueError):
    """A param's value does not match its schema, or it has none; the message names it."""


class _NoValue:
    def __repr__(self) -> str:
        return "NOTSET"


NOTSET: Any = _NoValue()


class Param:
    """``Param(default, description=None, **schema)``: ``schema`` holds JSON-schema keywords
    (``type``, ``enum``, ``minimum``, ``format`` ...), as in Airflow."""

    def __init__(self, default: Any = NOTSET, description: str | None = None, **schema: Any):
        self.value = default
        self.description = description
        self.schema = dict(schema)
        try:
            jsonschema.validators.validator_for(self.schema).check_schema(self.schema)
        except jsonschema.SchemaError as exc:
            raise ParamValidationError(f"invalid schema: {exc.message}") from None

    def __repr__(self) -> str:
        return f"Param({self.value!r}, schema={self.schema!r})"

    @property
    def has_value(self) -> bool:
        return self.value is not NOTSET

    def resolve(self, value: Any = NOTSET, name: str | None = None) -> Any:
        """``value`` (else the default) once checked against the schema."""
        given = self.value if value is NOTSET else value
        what = f"param {name!r}" if name else "param"
        if given is NOTSET:
            raise ParamValidationError(f"{what} has no value and no default")
        final = copy.deepcopy(given)
        try:
            jsonschema.validate(final, self.schema, format_checker=jsonschema.FormatChecker())
        except jsonschema.ValidationError as exc:
            raise ParamValidationError(f"{what}: {final!r} is invalid: {exc.message}") from None
        return final

    def dump(self) -> dict[str, Any]:
        return {
            "value": None if self.value is NOTSET else self.value,
            "description": self.description,
            "schema": self.schema,
        }


class ParamsDict(MutableMapping[str, Any]):
    """A mapping of names to values or ``Param``s; reading a key gives its checked value."""

    def __init__(self, dict_obj: Mapping[str, Any] | None = None) -> None:
        self._params: dict[str, Param] = {}
        for key, value in (dict_obj or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, Param):
            self._params[key] = value
        elif key in self._params:
            self._params[key].value = value
        else:
            self._params[key] = Param(value)

    def __getitem__(self, key: str) -> Any:
        return self._params[key].resolve(name=key)

    def __delitem__(self, key: str) -> None:
        del self._params[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def get_param(self, key: str) -> Param:
        return self._params[key]

    def validate(self) -> dict[str, Any]:
        """Every param's checked value; raises ParamValidationError naming the first bad one."""
        return {key: param.resolve(name=key) for key, param in self._params.items()}

    def dump(self) -> dict[str, Any]:
        return {key: param.dump() for key, param in self._params.items()}


def split_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Param]]:
    """``params`` as plain values (a ``Param``'s default, None if it has none: what templates,
    callbacks and the web UI see) and the ``Param``s among them (what a run's conf is checked
    against). Each default is checked against its schema; raises ParamValidationError."""
    values: dict[str, Any] = {}
    specs: dict[str, Param] = {}
    for key in params:
        value = params.get_param(key) if isinstance(params, ParamsDict) else params[key]
        if isinstance(value, Param):
            specs[key] = value
            values[key] = value.resolve(name=key) if value.has_value else None
        else:
            values[key] = value
    return values, specs
