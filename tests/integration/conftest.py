"""Fixtures of the integration tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import argon2
import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker.client import Broker
from deferral.loading.dagbag import process_dagbag
from deferral.runtime.config import Settings
from tests.parsed_dags import ParsedClient, record_dags_folder
from tests.servers import REDIS_URL
from webserver import users
from webserver.app import create_app
from worker.service import WorkerService

# The product's argon2 parameters (webserver/users.py), for the tests of argon2's own cost.
_PRODUCT_HASHER = users._hasher


@pytest.fixture(autouse=True)
def cheap_password_hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Passwords hashed and verified in this process with argon2's cheapest parameters: what
    the tests check of a login does not depend on the cost of its hash, and the product's cost
    (memory-hard on purpose) made every login of a test take most of its time on a busy
    machine. A hash stored with other parameters is still verified with its own. A test of
    argon2's own cost asks for ``product_password_hashes``."""
    monkeypatch.setattr(
        users, "_hasher", argon2.PasswordHasher.from_parameters(argon2.profiles.CHEAPEST)
    )
    users._dummy_hash.cache_clear()  # the hash a wrong user name is checked against
    yield
    users._dummy_hash.cache_clear()


@pytest.fixture
def product_password_hashes(cheap_password_hashes: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Passwords hashed and verified with the product's argon2 parameters."""
    monkeypatch.setattr(users, "_hasher", _PRODUCT_HASHER)
    users._dummy_hash.cache_clear()


@pytest.fixture
def worker(settings: Settings) -> Iterator[WorkerService]:
    """An in-process worker named "survivor" (two slots) on the default queue; tests drive its
    steps themselves."""
    # Its task processes are forked from this process (worker/children.py): not with the bag
    # of an earlier test's DAGs folder.
    process_dagbag.cache_clear()
    service = WorkerService(settings, queues=("default",), concurrency=2, name="survivor")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    yield service
    service.pool.shutdown()
    service.broker.close()


CLI_DAG_SOURCE = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{dag_id}") as dag:
    EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
"""


@pytest.fixture
def cli_dag(
    settings: Settings, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Path]
) -> str:
    """The id of a DAG (a >> b, empty operators) in the test's DAGs folder, parsed and recorded
    as a scheduler does (the display commands read only what was parsed)."""
    dag_id = f"cli_{uuid.uuid4().hex[:8]}"
    write_dag(dag_id, CLI_DAG_SOURCE.format(dag_id=dag_id))
    record_dags_folder(settings)
    return dag_id


# -- the web UI (tests/integration/test_webserver*.py) ---------------------------------------------

WEB_ADMIN_PASSWORD = "the-admin-password-42"
WEB_DAG = "web_dag"


def web_client(
    settings: Settings, host: str, extra: dict[str, str] | None = None, scheme: str = "http"
) -> TestClient:
    """The UI of a server listening on ``host`` (asked as localhost), its admin's password
    WEB_ADMIN_PASSWORD, ``extra`` added to its environment, beside a scheduler that records
    the DAGs folder before each request (``tests.parsed_dags``)."""
    environ = {users.ADMIN_PASSWORD_ENV: WEB_ADMIN_PASSWORD, **(extra or {})}
    app = create_app(settings, host=host, environ=environ)
    return ParsedClient(app, settings, base_url=f"{scheme}://localhost", follow_redirects=False)


@pytest.fixture
def web_dag(write_dag: Callable[[str, str], Path]) -> str:
    write_dag(WEB_DAG, CLI_DAG_SOURCE.format(dag_id=WEB_DAG))
    return WEB_DAG


@pytest.fixture
def local(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> Iterator[TestClient]:
    """The UI of a server listening on 127.0.0.1."""
    with web_client(settings, "127.0.0.1") as client:
        yield client


@pytest.fixture
def exposed(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> Iterator[TestClient]:
    """The UI of a server listening on every address."""
    with web_client(settings, "0.0.0.0") as client:
        yield client
