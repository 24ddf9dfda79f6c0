"""Metrics against a real Redis: the consumer core counts renewals, takeovers and dead letters;
a served registry shows the streams as they are; a port in use is refused in one line."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from broker.client import Broker
from broker.consumer import StreamConsumer
from broker.streams import QueueMessage, to_fields
from deferral.runtime import metrics
from deferral.runtime.crypto import Cipher
from deferral_cli.embedded import free_port
from tests.helpers import metrics_answer

GROUP = "workers"


def _consumer(broker: Broker, name: str, cipher: Cipher) -> StreamConsumer:
    consumer = StreamConsumer(
        broker,
        broker.keys.queue("default"),
        GROUP,
        name,
        heartbeat_sec=0.05,
        max_deliveries=5,
        cipher=cipher,
    )
    consumer.start()
    return consumer


def _publish(broker: Broker, n: int) -> None:
    for i in range(1, n + 1):
        message = QueueMessage(str(i), "1", f"d.r.t{i}", "mac")
        broker.publish(broker.keys.queue("default"), to_fields(message))


def _counted(name: str, stream: str) -> float:
    value = metrics.registry_for(metrics.WORKER).get_sample_value(name, {"stream": stream})
    return value or 0.0


def test_the_consumer_core_counts_renewals_takeovers_and_dead_letters(
    broker: Broker, cipher: Cipher
) -> None:
    stream = broker.keys.queue("default")
    renewed = _counted("deferral_lease_renewals_total", stream)
    taken = _counted("deferral_lease_takeovers_total", stream)
    dead = _counted("deferral_dead_letters_total", stream)
    _publish(broker, 3)
    mine = _consumer(broker, "w1", cipher)
    deliveries = mine.poll(3)
    assert len(deliveries) == 3
    time.sleep(0.06)  # held a whole heartbeat: not suspects if w1 dies now
    assert mine.renew() == []
    assert _counted("deferral_lease_renewals_total", stream) == renewed + 3

    time.sleep(0.2)  # past 2.1 x heartbeat without a renewal: w1 looks dead
    peer = _consumer(broker, "w2", cipher)
    claimed = peer.claim(10)
    assert len(claimed) == 3
    assert _counted("deferral_lease_takeovers_total", stream) == taken + 3

    peer.dead_letter(claimed[0], "bad queue entry: test")
    assert _counted("deferral_dead_letters_total", stream) == dead + 1


def test_a_served_registry_shows_the_streams(broker: Broker, cipher: Cipher) -> None:
    _publish(broker, 2)
    consumer = _consumer(broker, "w1", cipher)
    consumer.poll(1)
    metrics.STREAMS.watch(broker.stream_stats)
    shown = _scrape(metrics.SCHEDULER)
    stream = broker.keys.queue("default")
    assert f'deferral_stream_length{{stream="{stream}"}} 2.0' in shown
    assert f'deferral_stream_pending{{group="workers",stream="{stream}"}} 1.0' in shown
    assert f'deferral_stream_lag{{group="workers",stream="{stream}"}} 1.0' in shown
    assert "process_resident_memory_bytes" in shown
    assert "deferral_dispatches_total" in shown and "deferral_triggers_running" not in shown
    assert "_created" not in shown
    # The streams are the same whoever reads them: a worker does not repeat them.
    worker = _scrape(metrics.WORKER)
    assert "deferral_worker_slots_free" in worker and "deferral_stream_length" not in worker


def _scrape(service: str) -> str:
    port = free_port()
    metrics.serve(service, port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_a_port_in_use_is_refused_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(metrics.MetricsServerError) as raised:
            metrics.serve(metrics.SCHEDULER, port)
    assert str(raised.value) == f"--metrics-port {port}: Address already in use"


def test_metrics_listen_on_loopback_only_by_default() -> None:
    # 127.0.0.2 is this machine too: a server on every interface would answer there.
    port = free_port()
    metrics.serve(metrics.TRIGGERER, port)
    assert metrics_answer("127.0.0.1", port)  # bound before serve() returns
    assert not metrics_answer("127.0.0.2", port)


def test_metrics_listen_where_told() -> None:
    port = free_port()
    metrics.serve(metrics.TRIGGERER, port, "127.0.0.2")
    assert metrics_answer("127.0.0.2", port)  # bound before serve() returns
    assert not metrics_answer("127.0.0.1", port)


def test_a_host_that_is_not_here_is_refused_in_one_line() -> None:
    port = free_port()
    with pytest.raises(metrics.MetricsServerError) as raised:
        metrics.serve(metrics.SCHEDULER, port, "192.0.2.1")  # TEST-NET-1: on no interface
    assert str(raised.value) == "--metrics-host 192.0.2.1: Cannot assign requested address"
