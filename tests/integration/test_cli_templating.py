"""`deferral variables`, `deferral connections` and `deferral tasks render` against the test
database: one clear line and exit 1 for bad input; a password is never printed."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral import Variable
from deferral.authoring.templating import record_rendered_fields
from deferral.runtime.config import Settings
from deferral.store.tables import DagRun, TaskInstance
from deferral_cli import main as deferral_main
from tests.integration.factories import DAG_ID, running_task
from tests.parsed_dags import record_dags_folder


def deferral(*args: str) -> Result:
    return CliRunner().invoke(deferral_main, list(args))


def one_error_line(result: Result, message: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [f"error: {message}"]


# -- variables -----------------------------------------------------------------------------------


def test_variables_set_get_list_delete(settings: Settings, sessions: sessionmaker[Session]) -> None:
    assert deferral("variables", "list").output == "no variables\n"
    result = deferral("variables", "set", "bucket", "s3://b", "--description", "where")
    assert (result.exit_code, result.output) == (0, "Variable bucket created\n")
    assert deferral("variables", "set", "cfg", '{"a": [1, 2]}', "--json").exit_code == 0
    assert deferral("variables", "get", "bucket").output == "s3://b\n"
    assert json.loads(deferral("variables", "get", "cfg", "--json").output) == {"a": [1, 2]}
    assert deferral("variables", "get", "absent", "--default", "dflt").output == "dflt\n"
    listed = deferral("variables", "list").output.splitlines()
    assert listed[0].split() == ["KEY", "DESCRIPTION"]
    assert [line.split()[0] for line in listed[1:]] == ["bucket", "cfg"]
    assert "s3://b" not in deferral("variables", "list").output
    assert deferral("variables", "delete", "bucket").output == "Variable bucket deleted\n"
    one_error_line(deferral("variables", "get", "bucket"), "Variable bucket does not exist")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["get", "nope"], "Variable nope does not exist"),
        (["delete", "nope"], "Variable nope does not exist"),
        (
            ["set", "k", "{not json", "--json"],
            "VALUE of 'k' is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        (["set", "k" * 251, "v"], None),
    ],
)
def test_variables_bad_input_gets_one_line(
    settings: Settings, sessions: sessionmaker[Session], args: list[str], message: str | None
) -> None:
    result = deferral("variables", *args)
    if message is None:
        assert result.exit_code == 1 and "is 251 characters long" in result.output
    else:
        one_error_line(result, message)


def test_variables_get_of_a_non_json_value_with_json_names_it(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    Variable.set("text", "not json")
    one_error_line(
        deferral("variables", "get", "text", "--json"),
        "variable 'text' is not valid JSON: Expecting value: line 1 column 1 (char 0)",
    )


def test_variables_import_and_export_json_files(
    settings: Settings, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    source = tmp_path / "in.json"
    source.write_text(json.dumps({"plain": "text", "number": 3, "obj": {"a": [1]}}))
    result = deferral("variables", "import", str(source))
    assert result.exit_code == 0, result.output
    assert result.output == "3 of 3 variables successfully updated.\n"
    assert Variable.get("plain") == "text"
    assert Variable.get("number") == "3"
    assert Variable.get("obj", deserialize_json=True) == {"a": [1]}

    again = tmp_path / "again.json"
    again.write_text(json.dumps({"plain": "changed", "fresh": "new"}))
    skip = deferral("variables", "import", str(again), "--action-on-existing-key", "skip")
    assert skip.output.splitlines() == [
        "1 of 2 variables successfully updated.",
        "skipped, as they already exist: plain",
    ]
    assert Variable.get("plain") == "text"
    one_error_line(
        deferral("variables", "import", str(again), "-a", "fail"),
        f"{again}: these keys already exist: fresh, plain; nothing imported",
    )

    target = tmp_path / "out.json"
    result = deferral("variables", "export", str(target))
    assert result.output == f"4 variables successfully exported to {target}\n"
    assert json.loads(target.read_text()) == {
        "fresh": "new",
        "number": 3,
        "obj": {"a": [1]},
        "plain": "text",
    }


def test_variables_import_refuses_bad_files_in_one_line(
    settings: Settings, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{oops")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    one_error_line(
        deferral("variables", "import", str(broken)),
        f"{broken} is not valid JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
    )
    one_error_line(
        deferral("variables", "import", str(listed)),
        f"{listed} must hold a JSON object of variables, not list",
    )
    one_error_line(
        deferral("variables", "import", str(tmp_path / "absent.json")),
        f"cannot read {tmp_path / 'absent.json'}: No such file or directory",
    )
    assert deferral("variables", "list").output == "no variables\n"


# -- connections --------------------------------------------------------------------------------


URI = "postgres://etl:Pa55-w0rd!@db.example.com:5432/dw?sslmode=require&api_key=k3y-v4lue"


def test_connections_add_get_list_delete_never_print_the_password(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    added = deferral("connections", "add", "warehouse", "--conn-uri", URI)
    assert added.exit_code == 0, added.output
    assert added.output == (
        "Successfully added conn_id=warehouse: "
        "postgres://etl:***@db.example.com:5432/dw?sslmode=require&api_key=%2A%2A%2A\n"
    )
    got = deferral("connections", "get", "warehouse")
    assert got.exit_code == 0, got.output
    shown = dict(line.split(None, 1) for line in got.output.splitlines())
    assert shown == {
        "conn_id": "warehouse",
        "conn_type": "postgres",
        "description": "-",
        "host": "db.example.com",
        "schema": "dw",
        "login": "etl",
        "password": "***",
        "port": "5432",
        "extra": '{"sslmode": "require", "api_key": "***"}',
        "uri": "postgres://etl:***@db.example.com:5432/dw?sslmode=require&api_key=%2A%2A%2A",
        "source": "table",
    }
    listed = deferral("connections", "list").output
    assert listed.splitlines()[1].split() == [
        "warehouse",
        "postgres",
        "db.example.com",
        "5432",
        "dw",
        "etl",
        "***",
        "-",
    ]
    for output in (added.output, got.output, listed):
        assert "Pa55" not in output and "k3y" not in output
    deleted = deferral("connections", "delete", "warehouse")
    assert deleted.output == "Successfully deleted connection with conn_id=warehouse\n"
    one_error_line(
        deferral("connections", "get", "warehouse"), "The conn_id `warehouse` isn't defined"
    )


def test_connections_add_from_fields_and_from_json(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    result = deferral(
        "connections",
        "add",
        "api",
        "--conn-type",
        "http",
        "--conn-host",
        "https://api.example.com",
        "--conn-login",
        "bot",
        "--conn-password",
        "s3cret-field",
        "--conn-port",
        "443",
        "--conn-extra",
        '{"timeout": 5}',
        "--conn-description",
        "the API",
    )
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output
    as_json = deferral(
        "connections",
        "add",
        "queue",
        "--conn-json",
        '{"conn_type": "redis", "host": "q", "port": 6379, "password": "json-pw-123"}',
    )
    assert as_json.exit_code == 0, as_json.output
    api = dict(
        line.split(None, 1) for line in deferral("connections", "get", "api").output.splitlines()
    )
    assert (api["host"], api["port"], api["extra"], api["description"]) == (
        "https://api.example.com",
        "443",
        '{"timeout": 5}',
        "the API",
    )
    # A non-string extra value does not survive query parameters: it travels as __extra__.
    assert api["uri"] == (
        "http://https://bot:***@api.example.com:443/?__extra__=%7B%22timeout%22%3A+5%7D"
    )
    queue = deferral("connections", "get", "queue").output
    assert "json-pw-123" not in queue
    assert dict(line.split(None, 1) for line in queue.splitlines())["password"] == "***"


def test_connections_get_reads_the_environment_first(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_CONN_FROM_ENV", "mysql://u:env-pass-99@envhost/db")
    got = deferral("connections", "get", "from_env")
    assert got.exit_code == 0, got.output
    assert "source       environment (DEFERRAL_CONN_FROM_ENV)" in got.output
    assert "env-pass-99" not in got.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["c"], "give --conn-uri, --conn-json, or --conn-type (with the other --conn-* fields)"),
        (["c", "--conn-uri", "no-scheme"], "connection 'c': no '<conn_type>://' at its start"),
        (
            ["c", "--conn-uri", "postgres://u:secret-pw@h:port/db"],
            "connection 'c': bad port: Port could not be cast to integer value as 'port'",
        ),
        (
            ["c", "--conn-uri", "a://h", "--conn-host", "x"],
            "give only one of --conn-uri, --conn-type and the other fields",
        ),
        (
            ["c", "--conn-host", "x"],
            "--conn-type is required unless --conn-uri or --conn-json is given",
        ),
        (
            ["c", "--conn-type", "http", "--conn-extra", "{bad"],
            "connection 'c': extra is not valid JSON: Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1)",
        ),
        (["c", "--conn-json", "[1]"], "connection 'c': the JSON form must be an object"),
        (["bad id", "--conn-uri", "a://h"], "conn_id 'bad id' is invalid: use a non-empty word"),
    ],
)
def test_connections_add_bad_input_gets_one_line(
    settings: Settings, sessions: sessionmaker[Session], args: list[str], message: str
) -> None:
    result = deferral("connections", "add", *args)
    one_error_line(result, message)
    assert "secret-pw" not in result.output
    assert deferral("connections", "list").output == "no connections\n"


def test_connections_add_refuses_a_taken_id_and_delete_an_unknown_one(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    assert deferral("connections", "add", "dup", "--conn-uri", "http://h").exit_code == 0
    one_error_line(
        deferral("connections", "add", "dup", "--conn-uri", "http://other"),
        "a connection with conn_id 'dup' already exists",
    )
    one_error_line(
        deferral("connections", "delete", "ghost"),
        "no connection with conn_id 'ghost' in the table",
    )


# -- tasks render ----------------------------------------------------------------------------------


RENDER_DAG = """
from deferral import DAG
from deferral.operators import PythonOperator

with DAG("{dag_id}", params={{"x": "dag-x"}}) as dag:
    PythonOperator(
        task_id="t",
        python_callable=print,
        op_args=["{{{{ ds }}}}", "{{{{ params.x }}}}"],
        op_kwargs={{"pw": "{{{{ conn.render_conn.password }}}}"}},
    )
    PythonOperator(task_id="broken", python_callable=print, op_args=["{{{{ nope }}}}"])
"""


@pytest.fixture
def render_dag(settings: Settings, write_dag: Callable[[str, str], Path]) -> str:
    dag_id = f"render_{uuid.uuid4().hex[:8]}"
    write_dag(dag_id, RENDER_DAG.format(dag_id=dag_id))
    record_dags_folder(settings)  # a trigger reads what a scheduler parsed
    return dag_id


def test_tasks_render_shows_the_recorded_try_or_renders_now(
    settings: Settings,
    sessions: sessionmaker[Session],
    render_dag: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEFERRAL_CONN_RENDER_CONN", "http://u:render-pw-42@h")
    assert deferral("dags", "trigger", render_dag, "--run-id", "r1").exit_code == 0
    now = deferral("tasks", "render", render_dag, "r1", "t")
    assert now.exit_code == 0, now.output
    with sessions() as session:
        ds = session.scalars(select(DagRun.logical_date)).one().strftime("%Y-%m-%d")
    assert now.output.splitlines() == [
        f"# {render_dag}.r1.t: no try recorded yet; rendered now",
        "# ----------------------------------------------------------",
        "# property: templates_dict",
        "# ----------------------------------------------------------",
        "null",
        "# ----------------------------------------------------------",
        "# property: op_args",
        "# ----------------------------------------------------------",
        json.dumps([ds, "dag-x"], indent=2).splitlines()[0],
        *json.dumps([ds, "dag-x"], indent=2).splitlines()[1:],
        "# ----------------------------------------------------------",
        "# property: op_kwargs",
        "# ----------------------------------------------------------",
        *json.dumps({"pw": "***"}, indent=2).splitlines(),
    ]
    one_error_line(
        deferral("tasks", "render", render_dag, "r1", "broken"),
        "template field 'op_args[0]' of task 'broken': 'nope' is undefined",
    )


def test_tasks_render_shows_a_recorded_try(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions, task_id="t", run_id="r1")
    with sessions.begin() as session:
        record_rendered_fields(session, ti_id, 1, {"bash_command": "echo 2024-01-01"})
        record_rendered_fields(
            session, ti_id, 2, {"bash_command": "echo again", "env": {"Z": "1", "A": "2"}}
        )
    latest = deferral("tasks", "render", DAG_ID, "r1", "t")
    assert latest.exit_code == 0, latest.output
    lines = latest.output.splitlines()
    assert lines[0].startswith(f"# {DAG_ID}.r1.t try 2, rendered ")
    assert lines[1:] == [  # in the order the task declares its fields, and keys as rendered
        "# ----------------------------------------------------------",
        "# property: bash_command",
        "# ----------------------------------------------------------",
        "echo again",
        "# ----------------------------------------------------------",
        "# property: env",
        "# ----------------------------------------------------------",
        "{",
        '  "Z": "1",',
        '  "A": "2"',
        "}",
    ]
    first = deferral("tasks", "render", DAG_ID, "r1", "t", "--try", "1")
    assert first.output.splitlines()[-1] == "echo 2024-01-01"
    one_error_line(
        deferral("tasks", "render", DAG_ID, "r1", "t", "--try", "3"),
        f"{DAG_ID}.r1.t: nothing recorded for try 3 (tries recorded: 1, 2)",
    )
    one_error_line(
        deferral("tasks", "render", DAG_ID, "r9", "t"), f"DAG '{DAG_ID}' has no run 'r9'"
    )
    with sessions() as session:
        assert session.scalar(select(TaskInstance.try_number)) == 1
