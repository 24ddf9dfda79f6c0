"""The ``deferral`` command and package import only what is used: ``deferral --version`` loads no
database layer, DAG machinery or web stack, and what importing ``deferral`` used to do on the way
(the callback token's masked shape, ``partial()`` of operators) holds without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import click
import pytest
from click.testing import CliRunner
from cryptography.fernet import Fernet

import deferral
from deferral_cli import COMMANDS, main
from deferral_cli.dags import DAGS_ELSEWHERE, dags
from deferral_cli.group import Lazy, LazyGroup
from deferral_cli.tasks import TASKS_ELSEWHERE, tasks

# Top-level packages and modules ``deferral --version`` must not import.
HEAVY = (
    "alembic",
    "sqlalchemy",
    "starlette",
    "uvicorn",
    "jinja2",
    "deferral.store",
    "deferral.dag",
    "deferral.authoring",
    "deferral.baseoperator",
    "deferral.loading",
    "deferral.models",
    "broker",
    "readmodel",
    "scheduler",
    "triggerer",
    "worker",
    "webserver",
)


def heavy_imports(importtime_log: str) -> list[str]:
    """The modules of ``HEAVY`` (or under them) that ``python -X importtime`` logged."""
    names = [line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines()]
    return [n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY)]


def test_heavy_imports_reads_an_importtime_log() -> None:
    log = (
        "import time: self [us] | cumulative | imported package\n"
        "import time:       120 |        120 |   click\n"
        "import time:      4000 |      90000 |     sqlalchemy.orm\n"
        "import time:       300 |        300 | deferral.storage_units\n"
    )
    assert heavy_imports(log) == ["sqlalchemy.orm"]


def test_version_imports_no_database_layer_dag_machinery_or_web_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "deferral", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("python -m deferral ")
    assert heavy_imports(done.stderr) == []


# What ``deferral dags list`` must not import: it reads what a scheduler parsed, in one query.
NOT_FOR_A_LISTING = (
    "alembic",
    "redis",
    "broker",
    "deferral.dag",
    "deferral.loading",
    "deferral.store.transitions",
    "starlette",
    "webserver",
)


def test_dags_list_imports_no_dag_machinery_redis_client_or_web_stack() -> None:
    """Run against a PostgreSQL that does not answer (port 1): the imports are made before the
    query, and the unreachable server's error path must not import them either."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "DEFERRAL_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
        "DEFERRAL_REDIS_URL": "redis://127.0.0.1:1/0",
        "DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(),
    }
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "deferral", "dags", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, done.stderr  # PostgreSQL unreachable, said in one line
    assert "cannot reach PostgreSQL" in done.stderr
    names = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "sqlalchemy.orm" in names  # the log is read: the listing's own imports are there
    heavy = [n for n in names if any(n == h or n.startswith(h + ".") for h in NOT_FOR_A_LISTING)]
    assert heavy == []


@pytest.mark.parametrize(
    ("group", "table"),
    [(main, COMMANDS), (dags, DAGS_ELSEWHERE), (tasks, TASKS_ELSEWHERE)],
    ids=["deferral", "dags", "tasks"],
)
def test_help_lists_each_lazy_command_as_its_docstring_says(
    group: LazyGroup, table: dict[str, Lazy]
) -> None:
    context = click.Context(group)
    for name, lazy in table.items():
        command = group.get_command(context, name)
        assert command is not None, name
        listed = click.Command(name, help=lazy.summary).get_short_help_str(10_000)
        assert listed == command.get_short_help_str(10_000), name


def test_help_lists_commands_not_imported_yet() -> None:
    group = LazyGroup("g", lazy={"later": Lazy("no.such.module:command", "Done later.")})

    @group.command("now")
    def now() -> None:
        """Done now."""

    text = CliRunner().invoke(group, ["--help"]).output
    assert "later  Done later." in text and "now    Done now." in text


def test_dag_is_the_decorator_after_the_module_of_the_same_name_is_imported() -> None:
    import deferral.dag as dag_module  # noqa: F401  (the import binds it on the package)
    from deferral import dag
    from deferral.decorators import dag as decorator

    assert dag is decorator and deferral.dag is decorator
    assert deferral.DAG is sys.modules["deferral.dag"].DAG


def test_what_importing_deferral_did_holds_for_a_module_imported_alone() -> None:
    """In a fresh interpreter: an operator module alone maps with partial(), and a masker alone
    masks a callback token."""
    script = textwrap.dedent(
        """
        import sys
        from deferral.runtime.secrets_masker import SecretsMasker
        token = "12.1.1800000000.nonce." + "M" * 43
        assert SecretsMasker().redact(f"see {token}") == "see ***"
        assert "deferral.store.callback_tokens" not in sys.modules
        from deferral.operators.python import PythonOperator
        from deferral.dag import DAG
        with DAG("mapped", schedule=None) as dag:
            PythonOperator.partial(task_id="each", python_callable=print).expand(
                op_args=[[1], [2]]
            )
        assert dag.task_dict["each"].is_mapped
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
