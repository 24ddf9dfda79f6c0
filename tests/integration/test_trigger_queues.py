"""Trigger queues beyond the default one: the reconciler, doctor's in-flight check and the dead
letters find a trigger in its queue's stream, and a triggerer consumes the streams of the queues
it serves (every queue's, joining a new one, when given none)."""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker import deadletters
from broker.client import Broker
from broker.streams import GROUP_TRIGGERERS, trigger_message
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import liveness
from deferral.store.tables import Worker
from readmodel.doctor import _not_in_flight
from readmodel.explain import _queue_workers
from scheduler.reconcile import Reconciler
from tests.integration.factories import deferred_task
from tests.integration.test_dead_letters import dead_letter_via_consumer
from triggerer.service import TriggererService


def _deferred_on_queue(sessions: sessionmaker[Session], cipher: Cipher, queue: str) -> int:
    """A task of ``queue`` deferred an hour ago (settled: the reconciler looks at it)."""
    ti_id, trigger_id = deferred_task(sessions, cipher)
    with sessions.begin() as session:
        session.execute(
            text(
                "UPDATE task_instance SET queue = :queue, updated_at = now() - interval '1 hour'"
                " WHERE id = :id"
            ),
            {"queue": queue, "id": ti_id},
        )
    return trigger_id


def test_the_reconciler_republishes_a_lost_trigger_into_its_queues_stream(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    trigger_id = _deferred_on_queue(sessions, cipher, "gpu")
    assert _not_in_flight(broker, settings) == ["factory_dag.r1.t"]

    Reconciler(sessions, broker, cipher, settings.heartbeat_sec).reconcile()

    gpu = broker.keys.triggers_for("gpu")
    assert broker.present(gpu, [str(trigger_id)]) == {str(trigger_id): True}
    assert broker.redis.xlen(broker.keys.triggers) == 0
    assert _not_in_flight(broker, settings) == []
    assert gpu in broker.stream_keys() and gpu in broker.trigger_streams()


def test_a_dead_lettered_trigger_of_a_queue_is_re_driven_to_its_queues_stream(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    trigger_id = _deferred_on_queue(sessions, cipher, "gpu")
    Reconciler(sessions, broker, cipher, settings.heartbeat_sec).reconcile()
    gpu = broker.keys.triggers_for("gpu")
    dead_id = dead_letter_via_consumer(broker, cipher, gpu, GROUP_TRIGGERERS, "injected")
    assert broker.redis.xlen(gpu) == 0

    done = deadletters.retry(broker, sessions, cipher, dead_id)

    assert done.outcome is deadletters.Outcome.RETRIED, done
    assert broker.present(gpu, [str(trigger_id)]) == {str(trigger_id): True}


def test_a_triggerer_consumes_the_streams_of_its_queues_or_of_every_queue(
    settings: Settings, broker: Broker, cipher: Cipher
) -> None:
    keys = broker.keys
    broker.ensure_group(keys.triggers_for("gpu"), GROUP_TRIGGERERS)  # a gpu trigger was seen

    only_tpu = TriggererService(settings, capacity=10, name="t1", queues=("tpu",))
    only_tpu.attach(broker)
    assert only_tpu.consumer.streams == [keys.triggers_for("tpu")]

    every = TriggererService(settings, capacity=10, name="t2")
    every.attach(broker)
    every.consumer.start()
    assert every.consumer.streams == [keys.triggers, keys.triggers_for("gpu")]
    message = trigger_message(
        cipher, trigger_id=1, classpath="x.Y", kwargs={}, task_instance_id=1, try_number=1, task="t"
    )
    broker.publish(keys.triggers_for("new"), message)  # the first trigger of a new queue
    every._look_around()
    assert every.peers == 0  # no other triggerer row: it reads at full speed
    assert every.consumer.streams[-1] == keys.triggers_for("new")
    [delivery] = every.consumer.poll(10)
    assert delivery.entry.stream == keys.triggers_for("new")


def test_explain_counts_a_worker_of_several_queues_for_each_of_them(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    values = {"name": "w-ab", "hostname": "h", "pid": 1, "queue": "a,b", "concurrency": 1}
    with sessions.begin() as session:
        liveness.heartbeat(session, Worker, {**values, "load": 0, "state": liveness.RUNNING})
    with sessions() as session:
        now = session.scalars(select(func.now())).one()
        said = {q: _queue_workers(session, settings, q, now) for q in ("a", "b", "c")}
    assert (
        said["a"]
        == said["b"].replace("queue b", "queue a")
        == ("  1 alive worker(s) read queue a: w-ab")
    )
    assert said["c"].startswith("  no worker reading queue c is alive")
