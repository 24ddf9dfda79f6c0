"""deferral.connections: Airflow's connection URIs and JSON form, the environment first,
``BaseHook.get_connection``; a password is never in a repr or a masked URI."""

from __future__ import annotations

from typing import Any

import pytest

from deferral import Connection
from deferral.connections import ConnectionAccessor, InvalidConnection, from_environment
from deferral.hooks.base import BaseHook
from deferral.runtime.secrets_masker import redact


@pytest.fixture(autouse=True)
def _no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any lookup that reached the table would fail: these tests use the environment only."""
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", "u3p5mQ3YXbhOKWSFHl_NS1g6G0mwoyNu3B6Q38eTtuQ=")


def fields(conn: Connection) -> dict[str, Any]:
    names = ("conn_type", "host", "login", "password", "schema", "port", "extra_dejson")
    return {name: getattr(conn, name) for name in names}


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "postgres://user:pass@host:5432/db?param=x",
            {
                "conn_type": "postgres",
                "host": "host",
                "login": "user",
                "password": "pass",
                "schema": "db",
                "port": 5432,
                "extra_dejson": {"param": "x"},
            },
        ),
        (
            "postgresql://u@h/d",
            {
                "conn_type": "postgres",
                "host": "h",
                "login": "u",
                "password": None,
                "schema": "d",
                "port": None,
                "extra_dejson": {},
            },
        ),
        (
            "google-cloud-platform://?project=p&keyfile=%2Ftmp%2Fk.json",
            {
                "conn_type": "google_cloud_platform",
                "host": None,
                "login": None,
                "password": None,
                "schema": None,
                "port": None,
                "extra_dejson": {"project": "p", "keyfile": "/tmp/k.json"},
            },
        ),
        (
            "mysql://us%40er:p%40ss%3Aword%2F@db.example.com:3306/my%20schema",
            {
                "conn_type": "mysql",
                "host": "db.example.com",
                "login": "us@er",
                "password": "p@ss:word/",
                "schema": "my schema",
                "port": 3306,
                "extra_dejson": {},
            },
        ),
        (
            "http://https://api.example.com:8443/v1",
            {
                "conn_type": "http",
                "host": "https://api.example.com",
                "login": None,
                "password": None,
                "schema": "v1",
                "port": 8443,
                "extra_dejson": {},
            },
        ),
        (
            "aws://?__extra__=%7B%22region_name%22%3A+%22eu-west-1%22%2C+%22n%22%3A+%5B1%5D%7D",
            {
                "conn_type": "aws",
                "host": None,
                "login": None,
                "password": None,
                "schema": None,
                "port": None,
                "extra_dejson": {"region_name": "eu-west-1", "n": [1]},
            },
        ),
        (
            "postgres://%2Fvar%2Frun%2Fpostgresql/db",
            {
                "conn_type": "postgres",
                "host": "/var/run/postgresql",
                "login": None,
                "password": None,
                "schema": "db",
                "port": None,
                "extra_dejson": {},
            },
        ),
    ],
)
def test_uris_parse_as_airflow_parses_them(uri: str, expected: dict[str, Any]) -> None:
    assert fields(Connection(conn_id="c", uri=uri)) == expected


@pytest.mark.parametrize(
    "conn",
    [
        Connection(conn_id="a", uri="postgres://user:p%40ss@host:5432/db?sslmode=require"),
        Connection(
            conn_id="b",
            conn_type="google_cloud_platform",
            extra={"nested": {"deep": [1, 2]}, "flag": True},
        ),
        Connection(conn_id="c", conn_type="http", host="https://api.example.com", port=8443),
        Connection(conn_id="d", conn_type="ftp", login="who", password="p w/?#", port=21),
        Connection(conn_id="e", conn_type="redis", port=6379),
    ],
)
def test_get_uri_reads_back_to_the_same_fields(conn: Connection) -> None:
    assert fields(Connection(conn_id="again", uri=conn.get_uri())) == fields(conn)


def test_get_uri_writes_what_airflow_writes() -> None:
    conn = Connection(conn_id="a", uri="postgresql://user:p%40ss@Host:5432/db?sslmode=require")
    assert conn.get_uri() == "postgres://user:p%40ss@host:5432/db?sslmode=require"
    assert Connection(conn_id="b", conn_type="aws", extra='{"r": "x"}').get_uri() == "aws:///?r=x"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("just-a-host", "connection 'c': no '<conn_type>://' at its start"),
        ("postgres://h:abc/db", "connection 'c': bad port: Port could not be cast"),
        ("postgres://h:99999/db", "connection 'c': bad port: Port out of range"),
        ("a://b://c://d", "connection 'c': more than two '://' in it"),
        ("a://user@b://c", "connection 'c': a second '://' that does not follow a host protocol"),
        ("a://h?__extra__=%7B%7D&x=1", "connection 'c': '__extra__' must be the only query"),
        ("a://h?__extra__=nope", "connection 'c': extra is not valid JSON"),
        ("a://h?__extra__=%5B1%5D", "connection 'c': extra must be a JSON object, not list"),
    ],
)
def test_bad_uris_get_one_line_naming_the_connection_and_never_the_password(
    uri: str, message: str
) -> None:
    with pytest.raises(InvalidConnection) as info:
        Connection(conn_id="c", uri=uri)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_uri_and_fields_together_are_refused() -> None:
    with pytest.raises(InvalidConnection, match="give either a URI or the separate fields"):
        Connection(conn_id="c", uri="a://h", host="other")


def test_the_json_form_airflow_accepts() -> None:
    conn = Connection.from_json(
        '{"conn_type": "my-type", "login": "l", "password": "p", "host": "h", "port": "1234",'
        ' "schema": "s", "extra": {"param1": "val1"}}',
        conn_id="j",
    )
    assert fields(conn) == {
        "conn_type": "my_type",
        "host": "h",
        "login": "l",
        "password": "p",
        "schema": "s",
        "port": 1234,
        "extra_dejson": {"param1": "val1"},
    }
    with pytest.raises(InvalidConnection, match="connection 'j': not valid JSON"):
        Connection.from_json("{nope", conn_id="j")
    with pytest.raises(InvalidConnection, match="connection 'j': unknown field\\(s\\) hostname"):
        Connection.from_json('{"conn_type": "x", "hostname": "h"}', conn_id="j")
    with pytest.raises(InvalidConnection, match="connection 'j': port must be an integer"):
        Connection.from_json('{"conn_type": "x", "port": "eighty"}', conn_id="j")


def test_the_environment_is_read_first_as_a_uri_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_CONN_MY_DB", "postgres://u:pw-in-env@envhost:5432/envdb")
    monkeypatch.setenv("DEFERRAL_CONN_API", '{"conn_type": "http", "host": "api.example.com"}')
    assert BaseHook.get_connection("my_db").host == "envhost"  # no table lookup happened
    conn = Connection.get_connection_from_secrets("api")
    assert (conn.conn_type, conn.host, conn.conn_id) == ("http", "api.example.com", "api")
    accessor = ConnectionAccessor()
    assert accessor.my_db.schema == "envdb"
    assert accessor.get("api").host == "api.example.com"


def test_a_malformed_environment_connection_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEFERRAL_CONN_BROKEN", "postgres://u:secret-pw@h:port/db")
    with pytest.raises(InvalidConnection) as info:
        from_environment("broken")
    assert str(info.value).startswith("DEFERRAL_CONN_BROKEN: connection 'broken': bad port")
    assert "secret-pw" not in str(info.value)


def test_a_password_is_never_shown_and_is_masked_once_read() -> None:
    conn = Connection(
        conn_id="shown",
        uri="postgres://u:Very%2FSecret-1@h/db?api_key=extra-secret-9&region=eu",
    )
    assert repr(conn) == str(conn) == "shown"
    assert conn.masked_uri() == "postgres://u:***@h/db?api_key=%2A%2A%2A&region=eu"
    assert conn.masked_extra() == {"api_key": "***", "region": "eu"}
    assert redact(f"pw Very/Secret-1, quoted {conn.get_uri()}") == (
        "pw ***, quoted postgres://u:***@h/db?api_key=***&region=eu"
    )


def test_extra_dejson_and_getters() -> None:
    conn = Connection(conn_id="x", conn_type="http", password="p", extra='{"a": 1}')
    assert conn.extra_dejson == {"a": 1}
    assert (conn.get_password(), conn.get_extra()) == ("p", '{"a": 1}')
    assert Connection(conn_id="y", conn_type="http").extra_dejson == {}


def test_base_hook_is_a_base_for_user_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_CONN_WAREHOUSE_DEFAULT", "postgres://etl@wh:5432/dw")

    class WarehouseHook(BaseHook):
        conn_name_attr = "warehouse_conn_id"
        default_conn_name = "warehouse_default"
        conn_type = "postgres"
        hook_name = "Warehouse"

        def __init__(self, warehouse_conn_id: str = default_conn_name) -> None:
            super().__init__()
            self.warehouse_conn_id = warehouse_conn_id

        def get_conn(self) -> str:
            conn = self.get_connection(self.warehouse_conn_id)
            return f"{conn.login}@{conn.host}/{conn.schema}"

    assert WarehouseHook().get_conn() == "etl@wh/dw"
    assert WarehouseHook().log.name.endswith("WarehouseHook")
    with pytest.raises(NotImplementedError, match="BaseHook must implement get_conn"):
        BaseHook().get_conn()
