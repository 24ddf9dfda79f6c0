"""A signal payload is plaintext its sender picks, sealed with the Fernet keys: with read access
to the ``signal`` table and write access to Redis, it was once a valid trigger spec or dead
letter. Each purpose now seals under a key of its own, the triggerer checks a spec against its
trigger row, and dead letters carry a MAC: such forgeries run nothing, name the check they fail,
and show as unverified."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import msgspec
import pytest
from cryptography.fernet import Fernet
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker import deadletters
from broker.client import Broker
from broker.replies import Entry
from broker.streams import (
    GROUP_TRIGGERERS,
    DeadEntry,
    DeadLetterMessage,
    TriggerMessage,
    TriggerSpec,
    to_fields,
    trigger_message,
)
from deferral import signals
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.store.tables import Signal, TaskInstance
from tests.integration.factories import DAG_ID, deferred_task
from tests.integration.test_dead_letters import run
from triggerer.service import TriggererService
from triggerer.starting import Starter

FILE_TRIGGER = "deferral.triggers.file.FileTrigger"
TASK = f"{DAG_ID}.r1.t"


def _xadd(broker: Broker, stream: str, fields: dict[str, str]) -> str:
    """What a Redis writer does: a plain XADD."""
    flat = [x for kv in fields.items() for x in kv]
    return str(broker.redis.execute_command("XADD", stream, "*", *flat).decode())


def _signal_payload(sessions: sessionmaker[Session], cipher: Cipher, payload: object) -> str:
    """Send a signal with ``payload`` (what a user allowed to send one does), then read its
    sealed payload back from the ``signal`` table (what a reader of the database does)."""
    with sessions.begin() as session:
        sent = signals.send_in(session, cipher, f"k{id(payload)}", payload)
    with sessions() as session:
        return session.scalars(select(Signal.payload).where(Signal.id == sent.id)).one()


def _entry(cipher: Cipher, ti_id: int, trigger_id: int, **changes: object) -> TriggerMessage:
    """The entry try 1 of ``ti_id`` deferring on a past ``DateTimeTrigger`` publishes, sealed
    with the key, with ``changes`` to its spec."""
    spec: dict[str, object] = {
        "trigger_id": trigger_id,
        "classpath": "deferral.triggers.temporal.DateTimeTrigger",
        "kwargs": {"moment": "2020-01-01T00:00:00+00:00"},
        "task_instance_id": ti_id,
        "try_number": 1,
        "task": TASK,
        **changes,
    }
    return trigger_message(cipher, **spec)  # type: ignore[arg-type]


def _one_read(settings: Settings, broker: Broker) -> TriggererService:
    """A triggerer that reads the triggers stream once and starts what it may."""
    broker.ensure_group(broker.keys.triggers, GROUP_TRIGGERERS)
    service = TriggererService(settings, capacity=10, name="t1")
    service.attach(broker)
    service.consumer.start()

    async def read() -> None:
        async with anyio.create_task_group() as tasks:
            await service.starter.start_all(tasks, service.consumer.poll(10))
            tasks.cancel_scope.cancel()

    anyio.run(read)
    return service


def _dead_errors(broker: Broker) -> list[str]:
    return [e.fields[b"error"].decode() for e in broker.xrange(broker.keys.dead)]


def _state(sessions: sessionmaker[Session], ti_id: int) -> tuple[str, int | None]:
    with sessions() as session:
        ti = session.get_one(TaskInstance, ti_id)
        return ti.state, ti.trigger_id


def test_a_signal_payload_crafted_as_a_trigger_spec_runs_nothing_and_is_dead_lettered(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
    tmp_path: Path,
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    # A FileTrigger on a path that exists would fire at once and resume the task.
    spec = TriggerSpec(trigger_id, FILE_TRIGGER, {"filepath": str(tmp_path)}, ti_id, TASK, 1)
    sealed = _signal_payload(sessions, cipher, msgspec.to_builtins(spec))
    plain = cipher.decrypt(Purpose.SIGNAL_PAYLOAD, sealed)
    assert msgspec.json.decode(plain, type=TriggerSpec) == spec  # the plaintext is the spec
    entry = {"trigger_id": str(trigger_id), "classpath": FILE_TRIGGER, "task": TASK}
    _xadd(broker, broker.keys.triggers, {**entry, "token": sealed})
    # The same payload sent before purposes existed: sealed with the configured key itself.
    legacy = Fernet(settings.fernet_keys[0]).encrypt(plain).decode()
    _xadd(broker, broker.keys.triggers, {**entry, "token": legacy})

    service = _one_read(settings, broker)

    assert service.held == {}
    errors = _dead_errors(broker)
    assert len(errors) == 2
    assert all("token failed authentication as a trigger spec" in e for e in errors)
    assert _state(sessions, ti_id) == ("deferred", trigger_id)  # failed by nothing unproven
    assert broker.redis.xlen(broker.keys.events) == 0
    with pytest.raises(DecryptionError, match="as a dead letter"):
        cipher.decrypt(Purpose.DEAD_LETTER, sealed)


def test_a_sealed_spec_the_trigger_row_does_not_confirm_is_dead_lettered_naming_the_check(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    """Sealed with the key (what a bug in some other sealing path would make): the row still
    decides. Each mismatch fails its own check; the task is failed by none of them."""
    ti_id, trigger_id = deferred_task(sessions, cipher)

    for message in (
        _entry(cipher, ti_id, trigger_id, classpath=FILE_TRIGGER, kwargs={"filepath": "/"}),
        _entry(cipher, ti_id, trigger_id, task=f"{DAG_ID}.r1.other"),
        _entry(cipher, ti_id, trigger_id, try_number=2),
    ):
        broker.publish(broker.keys.triggers, message)

    service = _one_read(settings, broker)

    assert service.held == {}
    errors = sorted(_dead_errors(broker))
    assert [e.split(": ", 1)[1].split(":")[0] for e in errors] == [
        "classpath check",
        "task check",
        "try check",
    ]
    assert all(e.startswith(f"trigger {trigger_id} refused: ") for e in errors)
    assert _state(sessions, ti_id) == ("deferred", trigger_id)
    assert broker.redis.xlen(broker.keys.events) == 0


def test_forged_dead_letters_are_unverified_everywhere_and_never_retried(
    sessions: sessionmaker[Session], cipher: Cipher, broker: Broker, local: TestClient
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    spec = TriggerSpec(trigger_id, FILE_TRIGGER, {"filepath": "/"}, ti_id, TASK, 1)
    token = _signal_payload(sessions, cipher, msgspec.to_builtins(spec))
    # A signal payload crafted as a dead letter of a triggers entry carrying that token.
    fields = {"trigger_id": str(trigger_id), "classpath": FILE_TRIGGER, "task": TASK}
    inner = DeadEntry(broker.keys.triggers, "1-1", {**fields, "token": token}, "x", 1)
    sealed = _signal_payload(sessions, cipher, msgspec.to_builtins(inner))
    clear = (broker.keys.triggers, "1-1", "injected transient fault", "1", TASK, "t1")
    crafted = _xadd(broker, broker.keys.dead, to_fields(DeadLetterMessage(*clear, sealed)))
    # A "too large" letter: it keeps no entry, only clear fields anyone can write.
    too_large = _xadd(broker, broker.keys.dead, to_fields(DeadLetterMessage(*clear, "")))
    # An authentic "too large" one, for contrast.
    huge = Entry(broker.keys.triggers, "2-2", {b"task": TASK.encode(), b"x": b"y" * 300_000})
    broker.dead_letter(huge, GROUP_TRIGGERERS, "too big", cipher=cipher, consumer="t1")
    (authentic,) = [
        e.id for e in broker.xrange(broker.keys.dead) if e.id not in (crafted, too_large)
    ]

    for forged in (crafted, too_large):
        done = deadletters.retry(broker, sessions, cipher, forged)
        assert done.outcome == deadletters.Outcome.REFUSED
        assert done.detail.startswith("unverified: its MAC does not hold")
        cli = run("dead", "retry", forged)
        assert cli.exit_code == 1 and "unverified" in cli.stderr
        shown = run("dead", "show", "--reveal", forged).stdout
        assert "unverified: not proven to be written by deferral, not opened" in shown
        assert "filepath" not in shown and "FileTrigger" not in shown
    assert "not kept (the entry was too large)" in run("dead", "show", authentic).stdout
    listed = {r["id"]: r["verified"] for r in json.loads(run("dead", "list", "--json").stdout)}
    assert listed == {crafted: False, too_large: False, authentic: True}
    assert broker.redis.xlen(broker.keys.triggers) == 0
    assert _state(sessions, ti_id) == ("deferred", trigger_id)

    api = local.get("/api/v1/streams").json()["dead_letters"]
    assert {d["id"]: d["verified"] for d in api} == listed
    page = local.get("/streams").text
    assert page.count('class="dead-unverified"') == 2
    assert page.count('class="dead-verified"') == 1


def test_a_spec_nobody_waits_on_is_retired_unrun_and_not_dead_lettered(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    """An authentic entry whose task moved on while it sat in the stream (timed out, cleared):
    stale, not forged, so no dead letter to alarm anyone; and it runs nothing."""
    ti_id, trigger_id = deferred_task(sessions, cipher)
    message = _entry(cipher, ti_id, trigger_id)
    broker.publish(broker.keys.triggers, message)
    with sessions.begin() as session:
        session.get_one(TaskInstance, ti_id).state = "success"

    service = _one_read(settings, broker)

    assert service.held == {}
    assert _dead_errors(broker) == []
    assert broker.xrange(broker.keys.triggers) == []  # retired
    assert broker.redis.xlen(broker.keys.events) == 0


def test_when_postgresql_cannot_check_a_batch_none_of_it_starts(
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    message = _entry(cipher, ti_id, trigger_id)
    entry_id = broker.publish(broker.keys.triggers, message)

    def unreachable(self: Starter, specs: object) -> None:
        raise OperationalError("SELECT", {}, Exception("connection refused"))

    monkeypatch.setattr(Starter, "_trigger_rows", unreachable)
    service = _one_read(settings, broker)

    assert service.held == {}
    # Let go: taken over again later.
    assert not service.consumer.holds(Entry(broker.keys.triggers, entry_id, {}))
    assert [e.id for e in broker.xrange(broker.keys.triggers)] == [entry_id]
    assert _dead_errors(broker) == []
    assert _state(sessions, ti_id) == ("deferred", trigger_id)
