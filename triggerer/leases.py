"""The triggerer's leases, kept by a thread of their own that no trigger can block.

Every heartbeat the keeper renews the lease on every entry this triggerer holds (one
owner-checked Lua call per 250 entries, through its own Redis connection) and records the
triggerer as alive in Postgres (through its own engine). Each beat, with the entries it found
taken over or gone, is handed to the event loop (``on_beat``), without waiting for it: a trigger
that holds the loop in synchronous code for 30 s delays its neighbours, but its triggerer's
leases stay renewed, so no peer takes its entries over and nothing runs twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from broker import outage
from broker.client import Broker
from broker.consumer import Lost
from broker.consumers import ConsumerSet
from deferral.runtime.faults import is_transient

log = logging.getLogger("deferral.triggerer")


class LeaseKeeper:
    def __init__(
        self,
        consumer: ConsumerSet,
        broker: Broker,
        *,
        heartbeat_sec: float,
        register: Callable[[], None],
        on_beat: Callable[[list[Lost]], None],
    ) -> None:
        self.consumer = consumer
        self.broker = broker  # its own connections: the loop's threads never hold them
        self.heartbeat_sec = heartbeat_sec
        self.register = register
        self.on_beat = on_beat
        self.stop = threading.Event()
        self.beats = 0  # completed beats, for tests
        self._thread = threading.Thread(target=self._run, daemon=True, name="leases")

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop beating and wait for a beat under way (a renewal after the hand-off would undo
        it); then the broker's connections are closed."""
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.broker.close()

    def _run(self) -> None:
        while not self.stop.wait(self.heartbeat_sec):
            self.beat()

    def beat(self) -> None:
        """Renew, hand the beat on with what was lost, record the heartbeat. Never raises: a
        beat that fails is tried again at the next one (a lease missed now is renewed then, or
        taken by a peer)."""
        lost: list[Lost] = []
        try:
            lost = self.consumer.renew(via=self.broker)
        except Exception as exc:
            self._failed("renewing leases", exc)
        self.on_beat(lost)
        try:
            self.register()
        except Exception as exc:
            self._failed("recording the heartbeat", exc)
        self.beats += 1

    @staticmethod
    def _failed(what: str, exc: Exception) -> None:
        if outage.REDIS.failed(exc, what):
            return
        if is_transient(exc):
            log.warning("%s failed: %s", what, exc)
        else:
            log.exception("%s failed unexpectedly; trying again next heartbeat", what)
