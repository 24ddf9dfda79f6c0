"""An idle worker waits on Redis for entries only until its housekeeping falls due: the
heartbeat and the takeover scan run while nothing does, not right after an entry woke the loop,
between an attempt's start and its outcome."""

from __future__ import annotations

import time
from typing import Any

import pytest

from worker.service import IDLE_BLOCK_MS, WorkerService


def test_an_idle_worker_blocks_until_its_next_housekeeping_step_is_due(
    worker: WorkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks: list[int | None] = []
    poll = worker.consumer.poll

    def recording_poll(count: int, block_ms: int | None = None) -> Any:
        blocks.append(block_ms)
        return poll(count, block_ms=1)  # the test need not wait for real

    monkeypatch.setattr(worker.consumer, "poll", recording_poll)
    heartbeat, takeover = worker.periodic
    heartbeat.due = time.monotonic() + 60
    takeover.due = time.monotonic() + 0.4
    worker.step()
    takeover.due = time.monotonic() + 60
    worker.step()
    assert blocks[0] is not None and 300 <= blocks[0] <= 400
    assert blocks[1] == IDLE_BLOCK_MS
