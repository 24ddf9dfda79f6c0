"""The README's Fernet key rotation, end to end, with a task deferred under the old key whose
trigger entry (sealed with OLD) stays pending in deferral:triggers throughout:

- with NEW,OLD a restarted triggerer still reads the OLD entry; `rotate-fernet-key` re-seals
  Postgres; deleting the triggers stream and its index makes the reconciler republish the trigger
  sealed with NEW, after which OLD can go without a dead letter;
- OLD dropped too early (the entry still sealed with OLD): the entry is dead-lettered as a
  forgery, the reconciler republishes it from Postgres with NEW, and the task still succeeds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.store.tables import TaskInstance, Trigger
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
from deferral import DAG, BaseOperator
from deferral.triggers import FileTrigger


class WaitUntil(BaseOperator):
    def execute(self, context):
        path = context["dag_run"].conf["path"]
        self.defer(trigger=FileTrigger(path, poll_interval=0.2), method_name="done")

    def done(self, context, event):
        return "woke"


with DAG("rotate_me") as dag:
    WaitUntil(task_id="wait")
"""

SERVICES = (("scheduler", "--name", "s-1"), ("worker", "--name", "w-1", "--concurrency", "1"))
TRIGGERER = ("triggerer", "--name", "t-1")


def _start(services: Services, keys: str) -> None:
    """Start the services with ``keys`` and wait until each is up (the triggerer's consumer
    group exists before its pending list is asked)."""
    starts = {args[0]: services.starts(args[0]) for args in (*SERVICES, TRIGGERER)}
    for args in (*SERVICES, TRIGGERER):
        services.start(args[0], *args[1:], env={"DEFERRAL_FERNET_KEY": keys})
    for name, before in starts.items():
        services.wait_up(name, before)


def _restart(services: Services, keys: str) -> None:
    services.stop_all()
    _start(services, keys)


def _state(sessions: sessionmaker[Session]) -> str | None:
    with sessions() as session:
        return session.scalars(select(TaskInstance.state)).first()


def _trigger_token(broker: Broker) -> bytes:
    entries = broker.xrange(broker.keys.triggers)
    assert len(entries) == 1
    return entries[0].fields[b"token"]


def _deferred_under_old_key(
    services: Services, old: str, sessions: sessionmaker[Session], broker: Broker, fires: Path
) -> None:
    """The task deferred on a trigger that fires once the test creates ``fires``."""
    _start(services, old)
    triggered = services.run("dags", "trigger", "rotate_me", "--conf", f'{{"path": "{fires}"}}')
    assert triggered.returncode == 0, triggered.stderr
    wait_for(
        lambda: (
            _state(sessions) == "deferred"
            and broker.pending(broker.keys.triggers, "triggerers").count == 1
        ),
        timeout=90,
        what="the task to defer and its trigger to run",
    )
    Cipher([old]).decrypt(Purpose.TRIGGER_SPEC, _trigger_token(broker))  # sealed with OLD


def _rotate(services: Services, keys: str) -> str:
    rotated = services.run("rotate-fernet-key", env={"DEFERRAL_FERNET_KEY": keys})
    assert rotated.returncode == 0, rotated.stderr
    return rotated.stdout


@pytest.fixture
def keys() -> tuple[str, str]:
    return Fernet.generate_key().decode(), Fernet.generate_key().decode()


def test_rotation_with_the_streams_republished_drops_the_old_key_without_a_dead_letter(
    services: Services,
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: Callable[[str, str], Path],
    keys: tuple[str, str],
    tmp_path: Path,
) -> None:
    old, new = keys
    write_dag("rotate_me", DAG)
    fires = tmp_path / "fire"
    _deferred_under_old_key(services, old, sessions, broker, fires)

    # 1. NEW first, OLD kept: the restarted triggerer takes its OLD entry back and reads it.
    _restart(services, f"{new},{old}")
    wait_for(
        lambda: "t-1: replaying 1 entr(ies) of its own" in services.log("triggerer"),
        timeout=60,
        what="the triggerer to take its entry back",
    )
    # 2. Postgres re-sealed with NEW.
    assert "trigger.kwargs: 1 row(s) rotated" in _rotate(services, f"{new},{old}")
    with sessions() as session:
        sealed = session.scalars(select(Trigger.kwargs)).one()
    Cipher([new]).decrypt(Purpose.TRIGGER_KWARGS, sealed)
    # 3. The triggers stream rebuilt from Postgres: the entry is sealed with NEW.
    broker.redis.delete(broker.keys.triggers, broker.keys.inflight(broker.keys.triggers))
    token = wait_for(
        lambda: broker.xrange(broker.keys.triggers) and _trigger_token(broker),
        timeout=60,
        what="the reconciler to republish the trigger",
    )
    Cipher([new]).decrypt(Purpose.TRIGGER_SPEC, token)
    with pytest.raises(DecryptionError):
        Cipher([old]).decrypt(Purpose.TRIGGER_SPEC, token)
    # 4. OLD dropped, the trigger still waiting.
    assert _state(sessions) == "deferred"
    assert broker.redis.xlen(broker.keys.dead) == 0
    _restart(services, new)
    fires.touch()  # only a triggerer reading the NEW entry can run the trigger and see it
    wait_for(lambda: _state(sessions) == "success", timeout=120, what="the task to succeed")
    assert broker.redis.xlen(broker.keys.dead) == 0


def test_an_entry_still_sealed_with_a_dropped_key_is_dead_lettered_and_republished(
    services: Services,
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: Callable[[str, str], Path],
    keys: tuple[str, str],
    tmp_path: Path,
) -> None:
    old, new = keys
    write_dag("rotate_me", DAG)
    fires = tmp_path / "fire"
    _deferred_under_old_key(services, old, sessions, broker, fires)
    services.stop_all()
    _rotate(services, f"{new},{old}")

    _start(services, new)  # OLD dropped while the trigger entry is still sealed with it
    dead = wait_for(
        lambda: broker.xrange(broker.keys.dead),
        timeout=60,
        what="the OLD entry to be dead-lettered",
    )
    error = dead[0].fields[b"error"]
    assert b"rejected trigger entry" in error and b"failed authentication" in error, error
    fires.touch()
    wait_for(lambda: _state(sessions) == "success", timeout=120, what="the task to succeed")
