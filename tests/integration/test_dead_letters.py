"""`deferral dead list|show|retry|drop` on dead letters the real consumer code wrote: a retry
re-drives the sealed entry once and only while its work is wanted and not in flight; a forged,
stale or in-flight one changes nothing and says why."""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid

import msgspec
import pytest
from click.testing import CliRunner, Result
from cryptography.fernet import Fernet
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from broker import deadletters
from broker.client import Broker, dead_letter_message
from broker.consumer import StreamConsumer
from broker.replies import Entry
from broker.streams import (
    GROUP_SCHEDULERS,
    GROUP_TRIGGERERS,
    GROUP_WORKERS,
    DeadEntry,
    DeadLetterMessage,
    event_message,
    queue_message,
    signed_dead_letter,
    to_fields,
    trigger_message,
)
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import TaskState
from deferral.store import transitions
from deferral.store.tables import DagRun, ResumeEvent, TaskInstance
from deferral_cli import main as deferral_main
from tests.integration.factories import DAG_ID, deferred_task

CANARY = "canary-7f3a9c"
SECRET = "hunter2-not-for-eyes"


def run(*args: str) -> Result:
    return CliRunner().invoke(deferral_main, list(args))


def dead_letter_via_consumer(
    broker: Broker, cipher: Cipher, stream: str, group: str, reason: str
) -> str:
    """Read the newest entry of ``stream`` as the services' consumer core does and dead-letter
    it with ``reason``; the dead letter's id."""
    consumer = StreamConsumer(
        broker,
        stream,
        group,
        f"test-{uuid.uuid4().hex[:6]}",
        heartbeat_sec=1,
        max_deliveries=3,
        cipher=cipher,
    )
    consumer.start()
    (delivery,) = consumer.poll(1)
    consumer.dead_letter(delivery, reason)
    (newest,) = broker.newest(broker.keys.dead)
    return newest.id


def publish_trigger(broker: Broker, cipher: Cipher, ti_id: int, trigger_id: int) -> str:
    message = trigger_message(
        cipher,
        trigger_id=trigger_id,
        classpath="deferral.triggers.temporal.DateTimeTrigger",
        kwargs={"moment": "2020-01-01T00:00:00+00:00", "note": CANARY, "password": SECRET},
        task_instance_id=ti_id,
        try_number=1,
        task=f"{DAG_ID}.r1.t",
    )
    return broker.publish(broker.keys.triggers, message)


@pytest.fixture
def dead_trigger(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> tuple[str, int, int]:
    """A deferred task whose trigger entry the consumer core dead-lettered (a transient
    fault): (dead letter id, task instance id, trigger id)."""
    ti_id, trigger_id = deferred_task(sessions, cipher)
    publish_trigger(broker, cipher, ti_id, trigger_id)
    dead_id = dead_letter_via_consumer(
        broker, cipher, broker.keys.triggers, GROUP_TRIGGERERS, "injected transient fault"
    )
    return dead_id, ti_id, trigger_id


def in_stream(broker: Broker, stream: str) -> list[Entry]:
    return broker.xrange(stream)


# -- list, show, drop ------------------------------------------------------------------------------


def test_list_shows_the_dead_letter_newest_first_and_filters_by_stream(
    dead_trigger: tuple[str, int, int], broker: Broker, cipher: Cipher
) -> None:
    dead_id, _, _ = dead_trigger
    broker.publish(broker.keys.queue("q1"), queue_message(cipher, 99, 1, "d", "r", "t", -1))
    newer = dead_letter_via_consumer(
        broker, cipher, broker.keys.queue("q1"), GROUP_WORKERS, "bad queue entry: line1\nline2"
    )
    records = json.loads(run("dead", "list", "--json").stdout)
    assert [r["id"] for r in records] == [newer, dead_id]
    assert list(records[1]) == [
        "id",
        "added_at",
        "stream",
        "task",
        "deliveries",
        "reason",
        "verified",
    ]
    assert [r["verified"] for r in records] == [True, True]
    assert records[1]["stream"] == broker.keys.triggers
    assert records[1]["task"] == f"{DAG_ID}.r1.t"
    assert records[1]["deliveries"] == 1
    assert records[1]["reason"] == "injected transient fault"
    assert records[0]["reason"] == "bad queue entry: line1\\nline2"  # escaped: one line
    only = json.loads(run("dead", "list", "--stream", "triggers", "--json").stdout)
    assert [r["id"] for r in only] == [dead_id]
    assert [r["id"] for r in json.loads(run("dead", "list", "--limit", "1", "--json").stdout)] == [
        newer
    ]
    table = run("dead", "list")
    assert table.exit_code == 0
    assert table.stdout.splitlines()[0].split() == [
        "ID",
        "ADDED_AT",
        "STREAM",
        "TASK",
        "DELIVERIES",
        "REASON",
        "VERIFIED",
    ]
    assert CANARY not in table.stdout and SECRET not in table.stdout


def test_show_keeps_the_payload_sealed_unless_reveal(
    dead_trigger: tuple[str, int, int], broker: Broker
) -> None:
    dead_id, ti_id, trigger_id = dead_trigger
    shown = run("dead", "show", dead_id)
    assert shown.exit_code == 0, shown.output
    assert "injected transient fault" in shown.stdout
    assert "sealed (--reveal opens it" in shown.stdout
    assert CANARY not in shown.stdout and SECRET not in shown.stdout
    record = dict(line.split(":", 1) for line in shown.stdout.splitlines() if line[:1] != " ")
    record = {name: value.strip() for name, value in record.items()}
    assert record["consumer"].startswith("test-") and record["deliveries"] == "1"
    assert record["source_id"] == broker.xrange(broker.keys.dead)[0].fields[b"source_id"].decode()
    assert record["stream"] == broker.keys.triggers

    revealed = run("dead", "show", dead_id, "--reveal")
    assert revealed.exit_code == 0, revealed.output
    assert CANARY in revealed.stdout  # opened
    assert SECRET not in revealed.stdout  # a secret in it stays masked
    payload = revealed.stdout.split("payload:", 1)[1]
    fields = json.loads(payload)["fields"]
    assert fields["kwargs"]["password"] == "***"
    assert fields["trigger_id"] == str(trigger_id) and fields["task_instance_id"] == ti_id
    assert "token" not in fields  # ciphertext is not shown
    # Nothing in Redis holds the canary in clear either.
    raw = b"".join(k + v for e in broker.xrange(broker.keys.dead) for k, v in e.fields.items())
    assert CANARY.encode() not in raw


def test_drop_deletes_and_bad_ids_are_one_line(
    dead_trigger: tuple[str, int, int], broker: Broker
) -> None:
    dead_id, _, _ = dead_trigger
    missing = run("dead", "show", "1-0")
    assert (missing.exit_code, missing.stderr) == (1, "error: no dead letter 1-0\n")
    bad = run("dead", "retry", dead_id, "12;DROP")
    assert bad.exit_code == 2 and "'12;DROP' is not a dead letter id" in bad.stderr
    assert broker.redis.xlen(broker.keys.dead) == 1  # nothing done for the good id either

    dropped = run("dead", "drop", dead_id, "1-0")
    assert dropped.exit_code == 1
    assert dropped.stdout == f"dropped {dead_id}\n"
    assert dropped.stderr == "error: no dead letter 1-0\n"
    assert broker.redis.xlen(broker.keys.dead) == 0
    assert run("dead", "list").stdout == "no dead letters\n"


# -- retry -----------------------------------------------------------------------------------------


def test_retry_re_drives_a_wanted_trigger_once(
    dead_trigger: tuple[str, int, int], broker: Broker
) -> None:
    dead_id, _, trigger_id = dead_trigger
    assert in_stream(broker, broker.keys.triggers) == []
    done = run("dead", "retry", dead_id)
    assert done.exit_code == 0, done.output
    (entry,) = in_stream(broker, broker.keys.triggers)
    assert done.stdout == f"retried {dead_id}: now {broker.keys.triggers} {entry.id}\n"
    assert entry.fields[b"trigger_id"] == str(trigger_id).encode()
    # Published as PUBLISH does: the in-flight index names the new entry.
    assert broker.present(broker.keys.triggers, [str(trigger_id)]) == {str(trigger_id): True}
    assert broker.redis.xlen(broker.keys.dead) == 0

    again = run("dead", "retry", dead_id)
    assert again.exit_code == 1
    assert (
        again.stderr
        == f"error: {dead_id} not retried: no dead letter {dead_id} (dropped or retried)\n"
    )
    assert len(in_stream(broker, broker.keys.triggers)) == 1


def test_concurrent_retries_of_one_dead_letter_publish_once(
    dead_trigger: tuple[str, int, int],
    broker: Broker,
    sessions: sessionmaker[Session],
    cipher: Cipher,
) -> None:
    dead_id, _, _ = dead_trigger
    outcomes: list[deadletters.Outcome] = []
    start = threading.Barrier(4)

    def one() -> None:
        start.wait()
        outcomes.append(deadletters.retry(broker, sessions, cipher, dead_id).outcome)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes).count(deadletters.Outcome.RETRIED) == 1
    assert len(in_stream(broker, broker.keys.triggers)) == 1


def test_retry_refuses_while_the_work_is_in_flight(
    dead_trigger: tuple[str, int, int], broker: Broker, cipher: Cipher
) -> None:
    dead_id, ti_id, trigger_id = dead_trigger
    live = publish_trigger(broker, cipher, ti_id, trigger_id)  # as the reconciler would
    done = run("dead", "retry", dead_id)
    assert done.exit_code == 1
    assert f"its work is in flight already (entry {live})" in done.stderr
    assert [e.id for e in in_stream(broker, broker.keys.triggers)] == [live]
    assert broker.redis.xlen(broker.keys.dead) == 1


def test_retry_refuses_a_stale_trigger(
    dead_trigger: tuple[str, int, int], broker: Broker, sessions: sessionmaker[Session]
) -> None:
    dead_id, ti_id, trigger_id = dead_trigger
    with sessions.begin() as session:
        session.execute(
            update(TaskInstance).where(TaskInstance.id == ti_id).values(state=TaskState.SUCCESS)
        )
    done = run("dead", "retry", dead_id)
    assert done.exit_code == 1
    assert done.stderr == (
        f"error: {dead_id} not retried: stale: its task is success, no longer deferred on"
        f" trigger {trigger_id}\n"
    )
    assert in_stream(broker, broker.keys.triggers) == []
    assert broker.redis.xlen(broker.keys.dead) == 1


def _forge(broker: Broker, message: DeadLetterMessage) -> str:
    return broker.redis.execute_command(
        "XADD", broker.keys.dead, "*", *[x for kv in to_fields(message).items() for x in kv]
    ).decode()


def test_retry_refuses_forged_dead_letters(
    dead_trigger: tuple[str, int, int],
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
) -> None:
    dead_id, _, _ = dead_trigger
    (real,) = broker.xrange(broker.keys.dead)
    genuine = deadletters.read_dead_letter(cipher, real)
    # Sealed with a key we do not hold, naming a stream of the attacker's choice.
    foreign = Cipher([Fernet.generate_key().decode()])
    forged_entry = DeadEntry("elsewhere", "1-1", {"trigger_id": "1"}, "x", 1)
    forged = {
        "unknown key": DeadLetterMessage(
            "elsewhere",
            "1-1",
            "x",
            "1",
            "t",
            "c",
            foreign.encrypt(Purpose.DEAD_LETTER, msgspec.json.encode(forged_entry)),
        ),
        "garbage": DeadLetterMessage("elsewhere", "1-1", "x", "1", "t", "c", "not-a-token"),
        "copied": DeadLetterMessage(
            broker.keys.triggers, "2-2", "x", "1", "t", "c", real.fields[b"sealed"].decode()
        ),
        "no sealed entry": DeadLetterMessage(
            broker.keys.triggers, genuine.source_id, "x", "1", "t", "c", ""
        ),
        # As a process holding the key would write them: the sealed entry is checked still.
        "signed, copied": signed_dead_letter(
            cipher,
            DeadLetterMessage(
                broker.keys.triggers, "2-2", "x", "1", "t", "c", real.fields[b"sealed"].decode()
            ),
        ),
        "signed, no sealed entry": signed_dead_letter(
            cipher,
            DeadLetterMessage(broker.keys.triggers, genuine.source_id, "x", "1", "t", "c", ""),
        ),
    }
    ids = {name: _forge(broker, message) for name, message in forged.items()}
    outcomes = {name: deadletters.retry(broker, sessions, cipher, i) for name, i in ids.items()}
    assert {n: o.outcome for n, o in outcomes.items()} == dict.fromkeys(
        forged, deadletters.Outcome.REFUSED
    )
    for name in ("unknown key", "garbage", "copied", "no sealed entry"):
        assert outcomes[name].detail.startswith("unverified: its MAC does not hold"), name
    assert "not the one its clear fields name" in outcomes["signed, copied"].detail
    assert "kept no entry" in outcomes["signed, no sealed entry"].detail
    cli = run("dead", "retry", ids["garbage"])
    assert cli.exit_code == 1 and cli.stderr.count("\n") == 1
    assert in_stream(broker, broker.keys.triggers) == []
    assert broker.redis.xlen(broker.keys.dead) == 1 + len(forged)
    assert dead_id in {e.id for e in broker.xrange(broker.keys.dead)}


def test_retry_refuses_an_entry_that_was_forged_before_it_died(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    # A queue entry with a wrong MAC, dead-lettered by the consumer core: the dead letter is
    # genuine, the entry inside it is not, and re-driving it would be pointless.
    fields = to_fields(queue_message(cipher, 5, 1, "d", "r", "t", -1))
    fields["try_number"] = "2"
    broker.publish(broker.keys.queue("default"), fields)
    dead_id = dead_letter_via_consumer(
        broker, cipher, broker.keys.queue("default"), GROUP_WORKERS, "bad queue entry: forged"
    )
    done = deadletters.retry(broker, sessions, cipher, dead_id)
    assert done.outcome == deadletters.Outcome.REFUSED
    assert done.detail.startswith("the original entry is not valid: QueueMessage failed")
    assert in_stream(broker, broker.keys.queue("default")) == []


def _queued_task(sessions: sessionmaker[Session]) -> int:
    with sessions.begin() as session:
        transitions.create_dag_run(session, DAG_ID, "rq", dt.datetime.now(dt.UTC), {})
        run_row = session.scalars(select(DagRun).where(DagRun.run_id == "rq")).one()
        transitions.start_dag_run(
            session,
            run_row,
            [transitions.NewTaskInstance("q", 0, "default_pool", 1, "default", 1)],
        )
        session.flush()
        ti_id = session.scalars(select(TaskInstance.id).where(TaskInstance.run_id == "rq")).one()
        transitions.schedule(session, [ti_id])
        transitions.dispatch(session, [ti_id])
    return ti_id


def test_retry_of_a_queue_entry_needs_its_task_queued_at_that_try(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    ti_id = _queued_task(sessions)
    stream = broker.keys.queue("default")

    def dead_letter_attempt() -> str:
        broker.publish(stream, queue_message(cipher, ti_id, 1, DAG_ID, "rq", "q", -1))
        return dead_letter_via_consumer(broker, cipher, stream, GROUP_WORKERS, "injected")

    first = dead_letter_attempt()
    done = deadletters.retry(broker, sessions, cipher, first)
    assert done.outcome == deadletters.Outcome.RETRIED, done.detail
    (entry,) = in_stream(broker, stream)
    broker.retire(GROUP_WORKERS, [entry])  # as a worker that ran it would

    second = dead_letter_attempt()
    with sessions.begin() as session:
        assert transitions.start_many(session, [(ti_id, 1)], "host", "w")
    stale = deadletters.retry(broker, sessions, cipher, second)
    assert stale.outcome == deadletters.Outcome.REFUSED
    assert stale.detail == "stale: its task is running at try 1, not queued at try 1"
    assert in_stream(broker, stream) == []


def test_retry_of_an_event_needs_its_task_deferred_and_the_event_unapplied(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)

    def dead_event(dedup_key: str) -> str:
        message = event_message(cipher, trigger_id, dedup_key, "event", '{"n": 1}', "tr")
        broker.publish(broker.keys.events, message)
        return dead_letter_via_consumer(
            broker, cipher, broker.keys.events, GROUP_SCHEDULERS, "injected"
        )

    applied = dead_event("k-applied")
    with sessions.begin() as session:
        session.add(ResumeEvent(dedup_key="k-applied", trigger_id=trigger_id, outcome="stale"))
    refused = deadletters.retry(broker, sessions, cipher, applied)
    assert refused.detail == "stale: event k-applied was applied already"

    wanted = dead_event("k-new")
    done = deadletters.retry(broker, sessions, cipher, wanted)
    assert done.outcome == deadletters.Outcome.RETRIED, done.detail
    (entry,) = in_stream(broker, broker.keys.events)
    assert entry.fields[b"dedup_key"] == b"k-new"
    assert deadletters.retry(broker, sessions, cipher, wanted).outcome == "unknown"
    with sessions() as session:
        assert session.get(TaskInstance, ti_id).state == TaskState.DEFERRED  # type: ignore[union-attr]


def test_a_dead_letter_written_by_the_writer_opens(broker: Broker, cipher: Cipher) -> None:
    entry = Entry(broker.keys.triggers, "5-0", {b"trigger_id": b"1", b"task": b"x"})
    message = dead_letter_message(cipher, entry, "why", 2, "c")
    dead_id = broker.publish(broker.keys.dead, message)
    stored = broker.entry(broker.keys.dead, dead_id)
    assert stored is not None
    assert deadletters.open_sealed(broker, cipher, stored).fields == {
        "trigger_id": "1",
        "task": "x",
    }
