"""DEFERRAL_STREAM_SHARDS is fixed once chosen: the count is recorded on first start and a
service started with another refuses in one line; ``deferral reshard-streams`` changes it with
every service stopped (broker/DECISIONS.md)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, ShardCountError
from broker.streams import WAKE
from deferral.runtime.config import Settings
from deferral.store.liveness import RUNNING, heartbeat
from deferral.store.tables import Scheduler
from deferral_cli import main as deferral_main
from tests.forks import LANE


def _refusal(prefix: str, wanted: int, recorded: int) -> str:
    return (
        f"DEFERRAL_STREAM_SHARDS is {wanted} but the streams of {prefix!r} were started with"
        f" {recorded}: set it to {recorded}, or stop every service and run"
        f" `deferral reshard-streams --shards {wanted}`"
    )


@pytest.mark.parametrize("service", ["scheduler", "worker", "triggerer"])
def test_a_service_started_with_another_count_refuses_in_one_line(
    service: str, broker: Broker, service_env: dict[str, str]
) -> None:
    assert broker.recorded_shards() == 1  # recorded by the first connection
    env = {**os.environ, **service_env, "DEFERRAL_STREAM_SHARDS": "4"}
    # Its console script in a process of its own (forked with it imported: tests/forks.py).
    done = LANE.run(["consume"], env, timeout=120, script=service)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == _refusal(broker.keys.prefix, 4, 1)
    assert "Traceback" not in done.stderr
    assert broker.recorded_shards() == 1


def test_reshard_moves_the_entries_and_records_the_new_count(
    broker: Broker, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    prefix = broker.keys.prefix
    gpu = [broker.keys.trigger_stream("gpu", t) for t in range(1, 9)]
    broker.publish_many(
        [(stream, {"trigger_id": str(t)}) for t, stream in enumerate(gpu, start=1)]
        + [(broker.keys.events_for(t), {"trigger_id": str(t)}) for t in (5, 6)]
        + [(broker.keys.events, WAKE)]
    )
    with sessions() as session:  # a scheduler heartbeats: nothing is moved under it
        heartbeat(session, Scheduler, {"name": "s1", "hostname": "h", "pid": 1, "state": RUNNING})
        session.commit()
    refused = CliRunner().invoke(deferral_main, ["reshard-streams", "--shards", "4"])
    assert refused.exit_code == 1
    assert refused.output == "error: stop every service first: s1 still heartbeat(s)\n"
    with sessions() as session:
        heartbeat(session, Scheduler, {"name": "s1", "hostname": "h", "pid": 1, "state": "stopped"})
        session.commit()

    done = CliRunner().invoke(deferral_main, ["reshard-streams", "--shards", "4"])
    assert done.exit_code == 0, done.output
    assert done.output == "moved 10 entries (1 naming no trigger dropped): 1 -> 4 shards\n"

    with pytest.raises(ShardCountError) as raised:
        Broker.from_url(settings.redis_url, prefix)
    assert str(raised.value) == _refusal(prefix, 1, 4)
    resharded = Broker.from_url(settings.redis_url, prefix, shards=4)
    try:
        keys = resharded.keys
        assert keys.triggers_for("gpu", 1) == f"{prefix}:shard:01:triggers:gpu"
        for shard in range(4):
            in_shard = {str(t) for t in range(1, 9) if t % 4 == shard}
            entries = resharded.xrange(keys.triggers_for("gpu", shard))
            assert {e.fields[b"trigger_id"].decode() for e in entries} == in_shard
            assert all(
                resharded.present(keys.triggers_for("gpu", shard), sorted(in_shard)).values()
            )
        assert resharded.events_present(["5", "6"]) == {"5": True, "6": True}
        assert keys.triggers_for("gpu", 1) in resharded.trigger_streams()
        # The one-shard streams are gone, and no longer listed.
        assert not any(resharded.redis.exists(s, broker.keys.inflight(s)) for s in gpu)
        assert not resharded.redis.exists(broker.keys.events)
        assert set(gpu).isdisjoint(resharded.stream_keys())
    finally:
        resharded.close()
