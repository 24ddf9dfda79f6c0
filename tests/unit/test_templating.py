"""deferral.authoring.templating: template_fields rendered in a context with Airflow's variables, in
Jinja's sandbox, with StrictUndefined; what they rendered to, as recorded (secrets masked)."""

from __future__ import annotations

import datetime as dt
import json
from collections import namedtuple
from pathlib import Path
from typing import Any

import jinja2
import pytest

from deferral import DAG, BaseOperator
from deferral.authoring.templating import (
    MAX_RECORDED_LENGTH,
    TemplateRenderError,
    render_template_fields,
    rendered_fields,
)
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance, make_context
from deferral.exceptions import DagDefinitionError, FailTask
from deferral.operators import PythonOperator
from deferral.sensors import DateTimeSensor, FileSensor

LOGICAL = dt.datetime(2024, 3, 5, 6, 7, 8, tzinfo=dt.UTC)
START = dt.datetime(2024, 3, 4, tzinfo=dt.UTC)
END = dt.datetime(2024, 3, 5, tzinfo=dt.UTC)


class MemoryXComs:
    def __init__(self, values: dict[str, Any] | None = None) -> None:
        self.values = values or {}

    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        self.values[key] = value

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        return self.values.get(f"{task_id}/{key}")


class Templated(BaseOperator):
    template_fields = ("text", "data")

    def __init__(self, *, text: Any = None, data: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = text
        self.data = data

    def execute(self, context: Context) -> Any:
        return self.text


@pytest.fixture(autouse=True)
def _no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """Variables and Connections come from the environment here; the table is unreachable."""
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", "u3p5mQ3YXbhOKWSFHl_NS1g6G0mwoyNu3B6Q38eTtuQ=")
    monkeypatch.setenv("DEFERRAL_VAR_GREETING", "hello")
    monkeypatch.setenv("DEFERRAL_VAR_SETTINGS", '{"region": "eu", "sizes": [1, 2]}')
    monkeypatch.setenv("DEFERRAL_VAR_API_KEY", "key-abcdef-123")
    monkeypatch.setenv(
        "DEFERRAL_CONN_WAREHOUSE",
        "postgres://etl:s3cr%40t-pw@db.example.com:5433/analytics?sslmode=require",
    )


def context_for(
    task: BaseOperator,
    *,
    run: DagRunInfo | None = None,
    xcoms: MemoryXComs | None = None,
) -> Context:
    assert task.dag is not None
    ti = RuntimeTaskInstance(
        id=9,
        dag_id=task.dag.dag_id,
        run_id="manual__1",
        task_id=task.task_id,
        map_index=-1,
        try_number=2,
        xcoms=xcoms or MemoryXComs(),
        first_started_at=LOGICAL,
    )
    run = run or DagRunInfo(
        task.dag.dag_id,
        "manual__1",
        LOGICAL,
        {"from_conf": "c", "shared": "conf"},
        data_interval_start=START,
        data_interval_end=END,
        run_type="scheduled",
    )
    return make_context(task, run, ti)


def render(text: str) -> Any:
    task = Templated(task_id="t", text=text, dag=DAG("tmpl", params={"x": 1, "shared": "dag"}))
    render_template_fields(task, context_for(task))
    return task.text


# -- every context variable ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ ds }}", "2024-03-05"),
        ("{{ ds_nodash }}", "20240305"),
        ("{{ ts }}", "2024-03-05T06:07:08+00:00"),
        ("{{ ts_nodash }}", "20240305T060708"),
        ("{{ ts_nodash_with_tz }}", "20240305T060708+0000"),
        ("{{ logical_date.isoformat() }}", "2024-03-05T06:07:08+00:00"),
        ("{{ data_interval_start }}", "2024-03-04 00:00:00+00:00"),
        ("{{ data_interval_end | ds }}", "2024-03-05"),
        ("{{ params.x }} {{ params.shared }} {{ params.from_conf }}", "1 conf c"),
        ("{{ dag.dag_id }}", "tmpl"),
        ("{{ dag_run.run_id }} {{ dag_run.conf.from_conf }}", "manual__1 c"),
        ("{{ dag_run.run_type }} {{ dag_run.external_trigger }}", "scheduled False"),
        ("{{ task.task_id }}", "t"),
        ("{{ ti.task_id }} {{ ti.try_number }} {{ task_instance.map_index }}", "t 2 -1"),
        ("{{ run_id }}", "manual__1"),
        ("{{ try_number }}", "2"),
        ("{{ task_instance_key_str }}", "tmpl__t__20240305"),
        ("{{ var.value.greeting }}", "hello"),
        ("{{ var.value.get('greeting', 'fallback') }}", "hello"),
        ("{{ var.json.settings.region }} {{ var.json.settings.sizes[1] }}", "eu 2"),
        ("{{ conn.warehouse.host }}:{{ conn.warehouse.port }}", "db.example.com:5433"),
        ("{{ conn.warehouse.login }} {{ conn.warehouse.schema }}", "etl analytics"),
        ("{{ conn.warehouse.extra_dejson.sslmode }}", "require"),
        ("{{ macros.ds_add(ds, 7) }}", "2024-03-12"),
        ("{{ macros.ds_add(ds, -5) }}", "2024-02-29"),
        ("{{ macros.ds_format(ds, '%Y-%m-%d', '%d/%m/%y') }}", "05/03/24"),
        ("{{ (macros.datetime(2024, 1, 1) + macros.timedelta(days=2)).day }}", "3"),
        ("{{ macros.json.dumps({'a': 1}) }}", '{"a": 1}'),
        ("{{ execution_date | ds }}", "2024-03-05"),
        ("{{ next_ds }} {{ next_ds_nodash }}", "2024-03-05 20240305"),
        ("{{ yesterday_ds }} {{ tomorrow_ds_nodash }}", "2024-03-04 20240306"),
        ("{% do params.update({'y': 2}) %}{{ params.y }}", "2"),
    ],
)
def test_every_context_variable_renders(template: str, expected: str) -> None:
    assert render(template) == expected


def test_ti_xcom_pull_inside_a_template() -> None:
    dag = DAG("tmpl_xcom")
    task = Templated(
        task_id="t",
        text="{{ ti.xcom_pull(task_ids='up') }}-{{ ti.xcom_pull('up', key='k') }}",
        dag=dag,
    )
    render_template_fields(
        task, context_for(task, xcoms=MemoryXComs({"up/return_value": 41, "up/k": "v"}))
    )
    assert task.text == "41-v"


def test_a_manual_run_without_data_interval_gets_its_logical_date_for_both_ends() -> None:
    dag = DAG("tmpl_manual")
    task = Templated(
        task_id="t",
        text=(
            "{{ data_interval_start }}|{{ data_interval_end }}|{{ next_ds }}"
            "|{{ dag_run.data_interval_end | ds }}"
        ),
        dag=dag,
    )
    run = DagRunInfo("tmpl_manual", "manual__1", LOGICAL, {})
    render_template_fields(task, context_for(task, run=run))
    moment = "2024-03-05 06:07:08+00:00"
    assert task.text == f"{moment}|{moment}|2024-03-05|2024-03-05"


def test_dates_in_the_context_are_utc_whatever_zone_the_run_came_in() -> None:
    dag = DAG("tmpl_zone")
    task = Templated(task_id="t", text="{{ ds }} {{ ts }}", dag=dag)
    tokyo = LOGICAL.astimezone(dt.timezone(dt.timedelta(hours=9)))
    render_template_fields(task, context_for(task, run=DagRunInfo("tmpl_zone", "r", tokyo, {})))
    assert task.text == "2024-03-05 2024-03-05T06:07:08+00:00"


def test_task_params_merge_over_dag_params_and_default_args_and_conf_wins() -> None:
    dag = DAG(
        "tmpl_params",
        params={"a": "dag", "b": "dag", "c": "dag"},
        default_args={"params": {"b": "default"}},
    )
    task = Templated(
        task_id="t",
        text="{{ params.a }} {{ params.b }} {{ params.c }}",
        dag=dag,
        params={"c": "task"},
    )
    assert task.params == {"a": "dag", "b": "default", "c": "task"}
    run = DagRunInfo("tmpl_params", "r", LOGICAL, {"a": "conf"})
    render_template_fields(task, context_for(task, run=run))
    assert task.text == "conf default task"


def test_params_must_be_a_dict() -> None:
    with pytest.raises(DagDefinitionError, match="task 't': params must be a dict"):
        Templated(task_id="t", dag=DAG("tmpl_bad_params"), params=["x"])  # type: ignore[arg-type]


# -- what is rendered ----------------------------------------------------------------------------


Pair = namedtuple("Pair", ["left", "right"])


class Nested:
    template_fields = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner


def test_nested_lists_tuples_dicts_sets_and_objects_with_template_fields_render() -> None:
    nested = Nested("{{ ds_nodash }}")
    data = {
        "list": ["{{ ds }}", 3, None, ["{{ params.x }}"]],
        "tuple": ("{{ run_id }}", 1.5),
        "set": {"{{ params.x }}"},
        "pair": Pair("{{ params.x }}", "plain"),
        "deep": {"deeper": {"deepest": "{{ ti.task_id }}"}},
        "object": nested,
        "number": 7,
    }
    dag = DAG("tmpl_nested", params={"x": 1})
    task = Templated(task_id="t", data=data, dag=dag)
    render_template_fields(task, context_for(task))
    assert task.data == {
        "list": ["2024-03-05", 3, None, ["1"]],
        "tuple": ("manual__1", 1.5),
        "set": {"1"},
        "pair": Pair("1", "plain"),
        "deep": {"deeper": {"deepest": "t"}},
        "object": nested,
        "number": 7,
    }
    assert nested.inner == "20240305"
    assert data["list"][0] == "{{ ds }}"  # the operator's values are new objects


def test_an_object_referring_to_itself_renders_once() -> None:
    looped = Nested("{{ ds }}")
    looped.again = looped  # type: ignore[attr-defined]
    Nested.template_fields = ("inner", "again")
    try:
        dag = DAG("tmpl_loop")
        task = Templated(task_id="t", data=[looped, looped], dag=dag)
        render_template_fields(task, context_for(task))
    finally:
        Nested.template_fields = ("inner",)
    assert looped.inner == "2024-03-05"


def test_empty_values_are_left_alone_and_a_callable_field_renders_itself() -> None:
    seen: dict[str, Any] = {}

    def field(context: Context, jinja_env: jinja2.Environment) -> str:
        seen["env"] = jinja_env
        return f"called on {context['ds']}"

    dag = DAG("tmpl_callable")
    task = Templated(task_id="t", text=field, data="", dag=dag)
    render_template_fields(task, context_for(task))
    assert task.text == "called on 2024-03-05"
    assert isinstance(seen["env"], jinja2.sandbox.SandboxedEnvironment)
    assert task.data == ""


def test_template_fields_given_as_one_string_name_one_field() -> None:
    class OneField(BaseOperator):
        template_fields = "sql"  # type: ignore[assignment]  # a common slip; Airflow allows it

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.sql = "select '{{ ds }}'"

    task = OneField(task_id="t", dag=DAG("tmpl_one"))
    render_template_fields(task, context_for(task))
    assert task.sql == "select '2024-03-05'"


def test_a_template_field_the_operator_lacks_is_named() -> None:
    class Lacks(BaseOperator):
        template_fields = ("missing",)

    task = Lacks(task_id="t", dag=DAG("tmpl_lacks"))
    with pytest.raises(TemplateRenderError) as info:
        render_template_fields(task, context_for(task))
    assert (
        str(info.value) == "template field 'missing' of task 't': Lacks has no attribute 'missing'"
    )


def test_operator_methods_render_templates_as_airflow_operators_do() -> None:
    dag = DAG("tmpl_methods")
    task = Templated(task_id="t", text="{{ ds }}", dag=dag)
    context = context_for(task)
    assert task.render_template(["{{ ds_nodash }}", {"k": "{{ params.shared }}"}], context) == [
        "20240305",
        {"k": "conf"},
    ]
    task.render_template_fields(context, jinja_env=task.get_template_env())
    assert task.text == "2024-03-05"


# -- errors ----------------------------------------------------------------------------------------


def test_an_undefined_name_fails_naming_the_field_task_and_name() -> None:
    with pytest.raises(TemplateRenderError) as info:
        render("echo {{ nope }}")
    assert str(info.value) == "template field 'text' of task 't': 'nope' is undefined"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"a": ["ok", "{{ nope }}"]},
            "template field \"data['a'][1]\" of task 't': 'nope' is undefined",
        ),
        (
            "{{ params.missing }}",
            "template field 'data' of task 't': 'dict object' has no attribute 'missing'",
        ),
        ("{% if nope %}x{% endif %}", "template field 'data' of task 't': 'nope' is undefined"),
        ("{{ nope | upper }}", "template field 'data' of task 't': 'nope' is undefined"),
        (
            "{{ oops",
            "template field 'data' of task 't': syntax error at line 1: unexpected end of "
            "template, expected 'end of print statement'.",
        ),
    ],
)
def test_render_errors_name_the_field_path_and_never_render_empty(data: Any, message: str) -> None:
    dag = DAG("tmpl_errors")
    task = Templated(task_id="t", data=data, dag=dag)
    with pytest.raises(TemplateRenderError) as info:
        render_template_fields(task, context_for(task))
    assert str(info.value) == message


def test_the_sandbox_refuses_unsafe_attributes_and_calls() -> None:
    for template in (
        "{{ ''.__class__.__mro__ }}",
        "{{ ti.__dict__ }}",
        "{{ task._shallow_attrs }}",
        "{{ task.__init__.__globals__ }}",
    ):
        with pytest.raises(TemplateRenderError, match=r"access to attribute '_.*' .* is unsafe"):
            render(template)


def test_native_rendering_returns_objects_and_still_fails_on_undefined() -> None:
    dag = DAG("tmpl_native", render_template_as_native_obj=True, params={"n": 3})
    task = Templated(task_id="t", text="{{ [params.n, params.n + 1] }}", data="{{ nope }}", dag=dag)
    with pytest.raises(TemplateRenderError, match="'nope' is undefined"):
        render_template_fields(task, context_for(task))
    assert task.text == [3, 4]
    task = Templated(task_id="u", text="{{ ''.__class__ }}", dag=dag)
    with pytest.raises(TemplateRenderError, match="unsafe"):
        render_template_fields(task, context_for(task))


def test_user_defined_macros_and_filters() -> None:
    dag = DAG(
        "tmpl_user",
        user_defined_macros={"project": "acme", "double": lambda n: n * 2},
        user_defined_filters={"shout": lambda s: s.upper() + "!"},
    )
    task = Templated(task_id="t", text="{{ project | shout }} {{ double(21) }}", dag=dag)
    render_template_fields(task, context_for(task))
    assert task.text == "ACME! 42"


def test_template_undefined_may_be_relaxed_per_dag_as_in_airflow() -> None:
    dag = DAG("tmpl_lax", template_undefined=jinja2.Undefined)
    task = Templated(task_id="t", text="[{{ nope }}]", dag=dag)
    render_template_fields(task, context_for(task))
    assert task.text == "[]"


def test_a_value_ending_with_template_ext_is_a_template_file(tmp_path: Path) -> None:
    class Sql(BaseOperator):
        template_fields = ("sql",)
        template_ext = (".sql",)

        def __init__(self, *, sql: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.sql = sql

    (tmp_path / "query.sql").write_text("select * from t where day = '{{ ds }}'")
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "other.sql").write_text("select {{ params.x }}")
    dag = DAG("tmpl_files", template_searchpath=str(tmp_path / "more"), params={"x": 5})
    dag.fileloc = str(tmp_path / "dag_file.py")
    first = Sql(task_id="first", sql="query.sql", dag=dag)
    second = Sql(task_id="second", sql="other.sql", dag=dag)
    inline = Sql(task_id="inline", sql="select '{{ ds }}'", dag=dag)
    missing = Sql(task_id="missing", sql="absent.sql", dag=dag)
    for task in (first, second, inline):
        render_template_fields(task, context_for(task))
    assert (first.sql, second.sql, inline.sql) == (
        "select * from t where day = '2024-03-05'",
        "select 5",
        "select '2024-03-05'",
    )
    with pytest.raises(TemplateRenderError) as info:
        render_template_fields(missing, context_for(missing))
    assert str(info.value) == (
        "template field 'sql' of task 'missing': template file 'absent.sql' not found in the "
        "DAG's folder or template_searchpath"
    )


# -- the built-in operators' template fields --------------------------------------------------


def test_python_operator_renders_op_args_op_kwargs_and_templates_dict() -> None:
    def fn(
        day: str, *, when: str, templates_dict: dict[str, Any]
    ) -> tuple[str, str, dict[str, Any]]:
        return day, when, templates_dict

    dag = DAG("tmpl_python", params={"x": "p"})
    task = PythonOperator(
        task_id="t",
        python_callable=fn,
        op_args=["{{ ds }}"],
        op_kwargs={"when": "{{ params.x }}"},
        templates_dict={"query": "at {{ ts_nodash }}"},
        dag=dag,
    )
    context = context_for(task)
    render_template_fields(task, context)
    assert task.execute(context) == ("2024-03-05", "p", {"query": "at 20240305T060708"})


def test_sensor_targets_are_templated() -> None:
    dag = DAG("tmpl_sensors")
    files = FileSensor(task_id="f", filepath="/data/{{ ds_nodash }}/_SUCCESS", dag=dag)
    moment = DateTimeSensor(task_id="d", target_time="{{ data_interval_end }}", dag=dag)
    for task in (files, moment):
        render_template_fields(task, context_for(task))
    assert files.filepath == "/data/20240305/_SUCCESS"
    assert moment.target(context_for(moment)) == END


def test_date_time_sensor_names_a_target_that_is_not_a_date() -> None:
    task = DateTimeSensor(task_id="d", target_time="{{ ds }} at noon", dag=DAG("tmpl_bad_target"))
    context = context_for(task)
    render_template_fields(task, context)
    with pytest.raises(
        FailTask, match="task 'd': target_time '2024-03-05 at noon' is not an ISO 8601"
    ):
        task.target(context)


# -- what is recorded --------------------------------------------------------------------------


def test_recorded_fields_mask_passwords_and_secret_variables() -> None:
    class Secretive(BaseOperator):
        template_fields = ("command", "env", "password", "plain")

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.command = "psql {{ conn.warehouse.get_uri() }} -p {{ conn.warehouse.password }}"
            self.env = {
                "API_KEY": "{{ var.value.api_key }}",
                "GREETING": "{{ var.value.greeting }}",
                "token_file": "/x",
            }
            self.password = "{{ var.value.greeting }}"
            self.plain = ["{{ ds }}", dt.timedelta(hours=1)]

    task = Secretive(task_id="s", dag=DAG("tmpl_secret"))
    render_template_fields(task, context_for(task))
    assert task.command.endswith("-p s3cr@t-pw")  # the task itself gets the real values
    recorded = rendered_fields(task)
    assert recorded == {
        "command": "psql postgres://etl:***@db.example.com:5433/analytics?sslmode=require -p ***",
        "env": {"API_KEY": "***", "GREETING": "hello", "token_file": "***"},
        "password": "***",
        "plain": ["2024-03-05", "datetime.timedelta(seconds=3600)"],
    }
    assert "s3cr" not in json.dumps(recorded) and "key-abcdef" not in json.dumps(recorded)


def test_a_long_recorded_field_is_cut() -> None:
    task = Templated(task_id="t", text="x" * (MAX_RECORDED_LENGTH * 2), dag=DAG("tmpl_long"))
    recorded = rendered_fields(task)
    assert recorded["text"].startswith(f"(cut to {MAX_RECORDED_LENGTH} characters) ")
    assert len(recorded["text"]) < MAX_RECORDED_LENGTH + 50
