"""The trigger form built from a DAG's params, and the conf read back from it."""

from __future__ import annotations

import pytest

from deferral.models.param import Param, ParamsDict, split_params
from deferral.store.serialized_dags import stored_params
from webserver.inputs import BadInput
from webserver.paramform import ParamField, conf_from_form, fields

PARAMS = ParamsDict(
    {
        "who": Param("world", description="whom to greet", type="string", title="Who"),
        "times": Param(3, type="integer", minimum=1),
        "ratio": Param(0.5, type="number"),
        "loud": Param(False, type="boolean"),
        "colour": Param("red", enum=["red", "green"]),
        "tags": Param(["a"], type="array"),
        "needed": Param(type="string"),
        "password": Param("hunter22", type="string"),
        "plain": 7,
    }
)


def _fields() -> dict[str, ParamField]:
    values, specs = split_params(PARAMS)
    return {f.name: f for f in fields(stored_params(values, specs))}


def test_each_param_gets_a_field_of_its_kind_with_its_default() -> None:
    made = _fields()
    assert {name: f.kind for name, f in made.items()} == {
        "who": "text",
        "times": "integer",
        "ratio": "number",
        "loud": "boolean",
        "colour": "choice",
        "tags": "json",
        "needed": "text",
        "password": "text",
        "plain": "integer",
    }
    who = made["who"]
    assert (who.shown, who.title, who.description) == ("world", "Who", "whom to greet")
    assert made["colour"].choices == ['"red"', '"green"']
    assert made["needed"].required and made["needed"].shown == ""
    assert made["password"].shown == "***"


def test_the_posted_fields_give_typed_conf_and_untouched_masked_or_empty_ones_are_left_out() -> (
    None
):
    values, specs = split_params(PARAMS)
    form = {
        "param:who": "deferral",
        "param:times": "5",
        "param:ratio": "0.25",
        "param:loud": "true",
        "param:colour": '"green"',
        "param:tags": '["x", "y"]',
        "param:needed": "",
        "param:password": "***",
        "param:plain": "8",
    }
    assert conf_from_form(fields(stored_params(values, specs)), form) == {
        "who": "deferral",
        "times": 5,
        "ratio": 0.25,
        "loud": True,
        "colour": "green",
        "tags": ["x", "y"],
        "plain": 8,
    }


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("times", "five", "param 'times': 'five' is not a valid integer"),
        ("loud", "yes", "param 'loud': 'yes' is not a valid boolean"),
        ("colour", '"blue"', "param 'colour': '\"blue\"' is not a valid choice"),
        ("tags", "[1,", "param 'tags': '[1,' is not a valid json"),
    ],
)
def test_a_field_that_does_not_parse_is_refused_naming_the_param(
    name: str, raw: str, message: str
) -> None:
    values, specs = split_params(PARAMS)
    with pytest.raises(BadInput) as refused:
        conf_from_form(fields(stored_params(values, specs)), {f"param:{name}": raw})
    assert str(refused.value) == message
