"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker.streams import GROUP_WORKERS
from deferral.config import Settings
from worker.service import WorkerService


@pytest.fixture
def worker(settings: Settings) -> Iterator[WorkerService]:
    """An in-process worker named "survivor" (two slots) on the default queue; tests drive its
    steps themselves."""
    service = WorkerService(settings, queue="default", concurrency=2, name="survivor")
    service.broker.ensure_group(service.stream, GROUP_WORKERS)
    yield service
    service.pool.shutdown()
    service.broker.close()
