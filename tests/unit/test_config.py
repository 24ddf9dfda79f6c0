"""deferral.runtime.config: every missing or malformed setting is one ConfigError naming it."""

from __future__ import annotations

import base64
import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from deferral.runtime import config
from deferral.runtime.config import ConfigError, Settings, load_settings

# Fixed keys: they appear in test ids, which must be the same in every pytest-xdist worker.
KEY1 = base64.urlsafe_b64encode(bytes(range(32))).decode()
KEY2 = base64.urlsafe_b64encode(bytes(range(32, 64))).decode()
NO_TOML = Path("/nonexistent/deferral.toml")


def base_env(**overrides: str) -> dict[str, str]:
    env = {
        "DEFERRAL_DATABASE_URL": "postgresql+psycopg://user:pw@db.example:5432/deferral",
        "DEFERRAL_REDIS_URL": "redis://cache.example:6379/0",
        "DEFERRAL_FERNET_KEY": KEY1,
    }
    env.update(overrides)
    return env


def load(env: dict[str, str], toml: Path = NO_TOML) -> Settings:
    return load_settings(env, toml_path=toml)


def test_defaults() -> None:
    settings = load(base_env())
    assert settings.database_url == "postgresql+psycopg://user:pw@db.example:5432/deferral"
    assert settings.redis_url == "redis://cache.example:6379/0"
    assert settings.fernet_keys == (KEY1,)
    assert settings.dags_folder == Path("dags")
    assert settings.stream_prefix == "deferral"
    assert settings.heartbeat_sec == 5.0
    assert settings.triggerer_capacity == 1000
    assert settings.trigger_modules == ("deferral.triggers",)
    assert settings.default_deferrable is False


def test_environ_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in base_env(DEFERRAL_STREAM_PREFIX="fromenv").items():
        monkeypatch.setenv(key, value)
    assert load_settings(None, toml_path=NO_TOML).stream_prefix == "fromenv"


@pytest.mark.parametrize(
    "name", ["DEFERRAL_DATABASE_URL", "DEFERRAL_REDIS_URL", "DEFERRAL_FERNET_KEY"]
)
def test_missing_required_setting_is_named(name: str) -> None:
    env = base_env()
    del env[name]
    with pytest.raises(ConfigError, match=rf"^{name} is not set$"):
        load(env)


@pytest.mark.parametrize(
    "name", ["DEFERRAL_DATABASE_URL", "DEFERRAL_REDIS_URL", "DEFERRAL_FERNET_KEY"]
)
def test_empty_required_setting_is_not_set(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name} is not set$"):
        load(base_env(**{name: ""}))


def test_missing_toml_file_is_fine(tmp_path: Path) -> None:
    assert load(base_env(), tmp_path / "absent.toml").stream_prefix == "deferral"


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("DEFERRAL_DATABASE_URL", "not a url", "not a database URL"),
        ("DEFERRAL_DATABASE_URL", "mysql://u:pw@h/db", "expected a postgresql URL, got 'mysql'"),
        ("DEFERRAL_DATABASE_URL", "sqlite:///x.db", "expected a postgresql URL"),
        ("DEFERRAL_REDIS_URL", "http://cache.example:6379", "redis://"),
        ("DEFERRAL_REDIS_URL", "cache.example:6379", "redis://"),
        ("DEFERRAL_FERNET_KEY", "not-a-key", "key 1 is not a valid Fernet key"),
        ("DEFERRAL_FERNET_KEY", f"{KEY1},not-a-key", "key 2 is not a valid Fernet key"),
        ("DEFERRAL_FERNET_KEY", f"{KEY1}, {KEY2} ,short", "key 3 is not a valid Fernet key"),
        ("DEFERRAL_FERNET_KEY", " , ", "no key given"),
        ("DEFERRAL_HEARTBEAT_SEC", "0", "greater than 0"),
        ("DEFERRAL_HEARTBEAT_SEC", "-1", "greater than 0"),
        ("DEFERRAL_HEARTBEAT_SEC", "abc", "malformed"),
        ("DEFERRAL_HEARTBEAT_SEC", "nan", "greater than 0"),
        ("DEFERRAL_DAG_REFRESH_SEC", "0", "greater than 0"),
        ("DEFERRAL_DAG_REFRESH_SEC", "soon", "malformed"),
        ("DEFERRAL_TRIGGERER_CAPACITY", "0", "at least 1"),
        ("DEFERRAL_TRIGGERER_CAPACITY", "-5", "at least 1"),
        ("DEFERRAL_TRIGGERER_CAPACITY", "2.5", "malformed"),
        ("DEFERRAL_TRIGGERER_CAPACITY", "many", "malformed"),
        ("DEFERRAL_DEFAULT_DEFERRABLE", "maybe", "expected true or false"),
        ("DEFERRAL_DEFAULT_DEFERRABLE", "2", "expected true or false"),
        ("DEFERRAL_STREAM_PREFIX", "has space", "without spaces"),
        ("DEFERRAL_STREAM_PREFIX", ":::", "non-empty"),
        ("DEFERRAL_TRIGGER_MODULES", " , ", "no module prefix"),
        ("DEFERRAL_WORKER_TASK_PROCESS_MAX_ATTEMPTS", "0", "at least 1"),
        ("DEFERRAL_WORKER_TASK_PROCESS_MAX_ATTEMPTS", "unlimited", "malformed"),
    ],
)
def test_malformed_setting_is_named(name: str, value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(base_env(**{name: value}))
    message = str(info.value)
    assert message.startswith(f"{name} is malformed: ")
    assert fragment in message
    assert "\n" not in message


def test_malformed_database_url_does_not_leak_password() -> None:
    with pytest.raises(ConfigError) as info:
        load(base_env(DEFERRAL_DATABASE_URL="mysql://user:s3cr3t-pw@h/db"))
    assert "s3cr3t-pw" not in str(info.value)


def test_bad_fernet_key_is_not_echoed() -> None:
    bad = KEY2[:-3]
    with pytest.raises(ConfigError) as info:
        load(base_env(DEFERRAL_FERNET_KEY=f"{KEY1},{bad}"))
    assert bad not in str(info.value)
    assert KEY1 not in str(info.value)


def test_first_bad_setting_in_order_is_reported() -> None:
    env = base_env(DEFERRAL_REDIS_URL="http://x", DEFERRAL_HEARTBEAT_SEC="0")
    with pytest.raises(ConfigError, match="DEFERRAL_REDIS_URL"):
        load(env)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("postgresql://u:pw@h:5432/db", "postgresql+psycopg://u:pw@h:5432/db"),
        ("postgresql+psycopg2://u:pw@h/db", "postgresql+psycopg://u:pw@h/db"),
        ("postgresql+asyncpg://u:pw@h/db", "postgresql+psycopg://u:pw@h/db"),
        ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql://u:p%40ss@h/db", "postgresql+psycopg://u:p%40ss@h/db"),
    ],
)
def test_database_url_uses_psycopg_driver(raw: str, expected: str) -> None:
    url = make_url(load(base_env(DEFERRAL_DATABASE_URL=raw)).database_url)
    assert url.get_driver_name() == "psycopg"
    assert url == make_url(expected).set(drivername=url.drivername)


@pytest.mark.parametrize(
    "raw", ["postgresql+psycopg2://u:pw@h/db", "postgresql+asyncpg://u:pw@h/db"]
)
def test_other_driver_spellings_rewritten_to_explicit_psycopg(raw: str) -> None:
    assert load(base_env(DEFERRAL_DATABASE_URL=raw)).database_url == (
        "postgresql+psycopg://u:pw@h/db"
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("postgresql://u:pw@h:5432/db", "postgresql+psycopg://u:pw@h:5432/db"),
        ("postgresql://u:p%40ss@h/db", "postgresql+psycopg://u:p%40ss@h/db"),
    ],
)
def test_plain_postgresql_url_rewritten_to_explicit_psycopg(raw: str, expected: str) -> None:
    assert load(base_env(DEFERRAL_DATABASE_URL=raw)).database_url == expected


def test_password_with_special_characters_survives() -> None:
    url = make_url(load(base_env(DEFERRAL_DATABASE_URL="postgresql://u:p%40ss@h/db")).database_url)
    assert url.password == "p@ss"


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0", "rediss://user:pw@h:6380/1", "unix:///tmp/redis.sock"]
)
def test_redis_url_schemes_accepted(url: str) -> None:
    assert load(base_env(DEFERRAL_REDIS_URL=url)).redis_url == url


def test_several_fernet_keys_keep_order_and_strip_spaces() -> None:
    settings = load(base_env(DEFERRAL_FERNET_KEY=f" {KEY2} , {KEY1},"))
    assert settings.fernet_keys == (KEY2, KEY1)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("YES", True), (" On ", True), ("0", False), ("False", False)],
)
def test_bool_spellings(raw: str, expected: bool) -> None:
    assert load(base_env(DEFERRAL_DEFAULT_DEFERRABLE=raw)).default_deferrable is expected


def test_other_settings_parsed() -> None:
    settings = load(
        base_env(
            DEFERRAL_DAGS_FOLDER="/srv/dags",
            DEFERRAL_STREAM_PREFIX="myapp:",
            DEFERRAL_HEARTBEAT_SEC="0.5",
            DEFERRAL_TRIGGERER_CAPACITY="7",
            DEFERRAL_TRIGGER_MODULES="deferral.triggers, mycompany.triggers ,",
        )
    )
    assert settings.dags_folder == Path("/srv/dags")
    assert settings.stream_prefix == "myapp"
    assert settings.heartbeat_sec == 0.5
    assert settings.triggerer_capacity == 7
    assert settings.trigger_modules == ("deferral.triggers", "mycompany.triggers")


def test_toml_values_are_used(tmp_path: Path) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text(
        "[deferral]\n"
        'database_url = "postgresql://t:pw@tomlhost/db"\n'
        'redis_url = "redis://tomlhost:6379/2"\n'
        f'fernet_key = "{KEY2}"\n'
        "heartbeat_sec = 2\n"
        "triggerer_capacity = 50\n"
        "default_deferrable = true\n"
        'stream_prefix = "fromtoml"\n'
    )
    settings = load({}, toml)
    assert make_url(settings.database_url).host == "tomlhost"
    assert make_url(settings.database_url).get_driver_name() == "psycopg"
    assert settings.redis_url == "redis://tomlhost:6379/2"
    assert settings.fernet_keys == (KEY2,)
    assert settings.heartbeat_sec == 2.0
    assert settings.triggerer_capacity == 50
    assert settings.default_deferrable is True
    assert settings.stream_prefix == "fromtoml"


def test_toml_without_table_is_read_at_top_level(tmp_path: Path) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text('stream_prefix = "toplevel"\n')
    assert load(base_env(), toml).stream_prefix == "toplevel"


def test_env_overrides_toml(tmp_path: Path) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text('[deferral]\nstream_prefix = "fromtoml"\nheartbeat_sec = 9\n')
    settings = load(base_env(DEFERRAL_STREAM_PREFIX="fromenv"), toml)
    assert settings.stream_prefix == "fromenv"
    assert settings.heartbeat_sec == 9.0


def test_malformed_toml_value_is_named_like_env(tmp_path: Path) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text("[deferral]\ntriggerer_capacity = 0\n")
    with pytest.raises(ConfigError, match=r"^DEFERRAL_TRIGGERER_CAPACITY is malformed"):
        load(base_env(), toml)


def test_invalid_toml_file_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text("[deferral\nx = \n")
    with pytest.raises(ConfigError) as info:
        load(base_env(), toml)
    assert str(toml) in str(info.value)
    assert "not valid TOML" in str(info.value)


def test_toml_array_is_read_as_a_list_or_refused(tmp_path: Path) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text('[deferral]\ntrigger_modules = ["deferral.triggers", "mine.triggers"]\n')
    try:
        settings = load(base_env(), toml)
    except ConfigError as exc:
        assert "DEFERRAL_TRIGGER_MODULES" in str(exc)
        return
    assert settings.trigger_modules == ("deferral.triggers", "mine.triggers")


def test_load_settings_does_not_mutate_environ() -> None:
    env = base_env()
    before = dict(env)
    load(env)
    assert env == before


def test_default_deferrable_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEFERRAL_DEFAULT_DEFERRABLE", raising=False)
    assert config.default_deferrable() is False
    monkeypatch.setenv("DEFERRAL_DEFAULT_DEFERRABLE", "yes")
    assert config.default_deferrable() is True
    monkeypatch.setenv("DEFERRAL_DEFAULT_DEFERRABLE", "perhaps")
    with pytest.raises(ConfigError, match="DEFERRAL_DEFAULT_DEFERRABLE"):
        config.default_deferrable()


def test_core_at_scale_defaults() -> None:
    settings = load(base_env())
    assert settings.max_deliveries == 5
    assert settings.dag_import_grace_sec == 300.0
    assert settings.dag_refresh_sec == 10.0
    assert settings.prune_older_than == dt.timedelta(days=7)
    assert settings.default_timezone.key == "UTC"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("7d", dt.timedelta(days=7)),
        ("1d12h", dt.timedelta(days=1, hours=12)),
        ("30m", dt.timedelta(minutes=30)),
        ("45s", dt.timedelta(seconds=45)),
        ("90", dt.timedelta(seconds=90)),
        ("0.5h", dt.timedelta(minutes=30)),
    ],
)
def test_durations(raw: str, expected: dt.timedelta) -> None:
    assert config.parse_duration(raw) == expected


@pytest.mark.parametrize("raw", ["7 days", "d7", "-1", "7x", ""])
def test_bad_durations_name_the_text(raw: str) -> None:
    with pytest.raises(ValueError):
        config.parse_duration(raw)


def test_task_processes_are_recycled_after_ten_thousand_attempts_unless_set() -> None:
    assert load(base_env()).worker_task_process_max_attempts == 10_000
    env = base_env(DEFERRAL_WORKER_TASK_PROCESS_MAX_ATTEMPTS="50")
    assert load(env).worker_task_process_max_attempts == 50


def test_prune_can_be_turned_off() -> None:
    assert load(base_env(DEFERRAL_PRUNE_OLDER_THAN="off")).prune_older_than is None


@pytest.mark.parametrize(
    ("name", "raw", "fragment"),
    [
        ("DEFERRAL_MAX_DELIVERIES", "0", "DEFERRAL_MAX_DELIVERIES is malformed"),
        ("DEFERRAL_DAG_IMPORT_GRACE_SEC", "-3", "DEFERRAL_DAG_IMPORT_GRACE_SEC is malformed"),
        ("DEFERRAL_PRUNE_OLDER_THAN", "soon", "DEFERRAL_PRUNE_OLDER_THAN is malformed"),
        ("DEFERRAL_DEFAULT_TIMEZONE", "Mars/Olympus", "DEFERRAL_DEFAULT_TIMEZONE is malformed"),
        (
            "DEFERRAL_TRIGGERER_STALL_THRESHOLD_SEC",
            "0",
            "DEFERRAL_TRIGGERER_STALL_THRESHOLD_SEC is malformed",
        ),
    ],
)
def test_bad_core_settings_name_the_setting(name: str, raw: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load(base_env(**{name: raw}))


def test_naive_datetimes_are_read_in_the_default_timezone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deferral.timezone import make_aware

    naive = dt.datetime(2024, 1, 1, 6, 0)
    assert make_aware(naive) == dt.datetime(2024, 1, 1, 6, 0, tzinfo=dt.UTC)
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "Europe/Paris")
    assert make_aware(naive) == dt.datetime(2024, 1, 1, 5, 0, tzinfo=dt.UTC)
    aware = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    assert make_aware(aware) is aware


def test_dag_ignore_file_syntax_default_glob_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(base_env()).dag_ignore_file_syntax == "regexp"
    assert load(base_env(DEFERRAL_DAG_IGNORE_FILE_SYNTAX="Glob")).dag_ignore_file_syntax == "glob"
    with pytest.raises(ConfigError, match="DEFERRAL_DAG_IGNORE_FILE_SYNTAX is malformed"):
        load(base_env(DEFERRAL_DAG_IGNORE_FILE_SYNTAX="fnmatch"))
    monkeypatch.setenv("DEFERRAL_DAG_IGNORE_FILE_SYNTAX", "glob")
    assert config.dag_ignore_file_syntax() == "glob"
    monkeypatch.setenv("DEFERRAL_DAG_IGNORE_FILE_SYNTAX", "fnmatch")
    with pytest.raises(ConfigError, match="DEFERRAL_DAG_IGNORE_FILE_SYNTAX"):
        config.dag_ignore_file_syntax()


def test_the_triggerers_stall_threshold_defaults_to_a_fifth_of_a_second() -> None:
    assert load(base_env()).triggerer_stall_threshold_sec == 0.2
    custom = load(base_env(DEFERRAL_TRIGGERER_STALL_THRESHOLD_SEC="1.5"))
    assert custom.triggerer_stall_threshold_sec == 1.5


# -- secrets from files (Docker secrets) ---------------------------------------------------------


def test_a_secret_is_read_from_the_file_its_file_setting_names(tmp_path: Path) -> None:
    key = base_env()["DEFERRAL_FERNET_KEY"]
    (tmp_path / "fernet").write_text(key + "\n")  # as `echo key > file` writes it
    env = base_env()
    del env["DEFERRAL_FERNET_KEY"]
    env["DEFERRAL_FERNET_KEY_FILE"] = str(tmp_path / "fernet")
    assert load(env).fernet_keys == (key,)


def test_a_secret_and_its_file_both_set_is_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / "fernet").write_text("x")
    env = base_env(DEFERRAL_FERNET_KEY_FILE=str(tmp_path / "fernet"))
    with pytest.raises(ConfigError) as caught:
        load(env)
    assert str(caught.value) == (
        "DEFERRAL_FERNET_KEY and DEFERRAL_FERNET_KEY_FILE are both set: set one"
    )


def test_an_unreadable_secret_file_is_named_without_its_contents(tmp_path: Path) -> None:
    env = base_env()
    del env["DEFERRAL_REDIS_URL"]
    env["DEFERRAL_REDIS_URL_FILE"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError) as caught:
        load(env)
    assert str(caught.value) == (
        f"DEFERRAL_REDIS_URL_FILE: cannot read {tmp_path / 'missing'}: No such file or directory"
    )


def test_the_database_password_from_a_file_goes_into_the_url(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cr:t/@\n")
    env = base_env(
        DEFERRAL_DATABASE_URL="postgresql://deferral@db:5432/deferral",
        DEFERRAL_DATABASE_PASSWORD_FILE=str(tmp_path / "pw"),
    )
    url = make_url(load(env).database_url)
    assert url.password == "s3cr:t/@" and url.username == "deferral" and url.host == "db"


def test_the_admin_password_may_come_from_a_file(tmp_path: Path) -> None:
    from webserver import users

    (tmp_path / "admin").write_text("correct horse\n")
    env = {"DEFERRAL_WEBSERVER_ADMIN_PASSWORD_FILE": str(tmp_path / "admin")}
    assert users.admin_password(env) == "correct horse"
    assert users.admin_password({}) is None
