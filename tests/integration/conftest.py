"""Fixtures of the integration tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.client import Broker
from deferral.config import Settings
from tests.servers import REDIS_URL
from worker.service import WorkerService


@pytest.fixture
def worker(settings: Settings) -> Iterator[WorkerService]:
    """An in-process worker named "survivor" (two slots) on the default queue; tests drive its
    steps themselves."""
    service = WorkerService(settings, queue="default", concurrency=2, name="survivor")
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
def cli_dag(write_dag: Callable[[str, str], Path]) -> str:
    """The id of a DAG (a >> b, empty operators) in the test's DAGs folder."""
    dag_id = f"cli_{uuid.uuid4().hex[:8]}"
    write_dag(dag_id, CLI_DAG_SOURCE.format(dag_id=dag_id))
    return dag_id
