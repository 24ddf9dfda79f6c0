"""Group commit of the signals sent through the API: the sends that arrive while others are
being written go together, in one transaction, one commit and one wake of the schedulers.

A thread (BATCH_THREADS) takes what is queued (at most BATCH_MOST sends) and writes it.
One statement (``tokens.checked_and_locking``) checks the tokens' rows (a token revoked since
its request was verified is refused, in every replica, from the revocation's commit on) and
takes every key's lock at once, in lock-id order (two batches never wait on each other in a
cycle); the sends without an idempotency key are then recorded together
(``deferral.signals.send_many_in``: the first statement that records them sent in the same
round trip as the BEGIN and the locks, and one resume for what they matched), each with its
own answer; a token found revoked rolls that back and the batch is written again without its
sends. A send with an idempotency key is written after them as ``deferral.signals.send_in``
writes it alone; a send refused for its payload or its idempotency key writes nothing and
leaves the others be.
If a statement fails (a deadlock, a lost connection), the transaction is rolled back and each
send is written again in a transaction of its own, so each gets its own answer and none is
recorded twice. A commit that fails fails its whole batch (whether it was recorded is unknown,
as for one send).

The event loop hands a send over and awaits its answer (``send``): no thread-pool hand-off per
request, and the threads' database work runs beside the loop's HTTP work.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from deferral import signals
from deferral.runtime.crypto import Cipher
from webserver import tokens

log = logging.getLogger("deferral.webserver")

# Threads writing batches. One: what comes while it writes a batch waits for the next, so the
# batches are larger and a signal pays less of a transaction (a second thread overlapped the
# commits but halved the batches: more CPU per signal on both sides, fewer signals a second on
# a loaded machine; benchmarks/README.md). A batch that waits for a key's lock holds up the
# sends behind it for that long (a deferral's transaction on that key).
BATCH_THREADS = 1
# Sends written in one transaction at most.
BATCH_MOST = 64


@dataclass(frozen=True)
class Send:
    """One signal to send: ``token_id``, the API token it comes with (None: a user's)."""

    key: str
    payload: Any
    sender: signals.Sender
    idempotency_key: str | None
    token_id: int | None


Outcome = signals.SentSignal | Exception
_Item = tuple[Send, asyncio.AbstractEventLoop, "asyncio.Future[signals.SentSignal]"]


def _settle(future: asyncio.Future[signals.SentSignal], outcome: Outcome) -> None:
    if future.cancelled():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class SignalBatches:
    def __init__(
        self, sessions: sessionmaker[Session], cipher: Cipher, wake: Callable[[], None]
    ) -> None:
        self._sessions = sessions
        self._cipher = cipher
        self._wake = wake
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    async def send(self, item: Send) -> signals.SentSignal:
        """Record the signal (with the sends queued beside it); its answer, or its error
        (``tokens.Revoked``, ``SignalError``, ``IdempotencyConflict``, a database error)."""
        self._start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[signals.SentSignal] = loop.create_future()
        self._queue.put((item, loop, future))
        return await future

    def _start(self) -> None:
        if len(self._threads) == BATCH_THREADS:
            return
        with self._lock:
            while len(self._threads) < BATCH_THREADS:
                thread = threading.Thread(target=self._run, name="signal-batches", daemon=True)
                thread.start()
                self._threads.append(thread)

    def close(self) -> None:
        """End the threads once what is queued is written."""
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
            for thread in self._threads:
                thread.join(timeout=30)
            self._threads.clear()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < BATCH_MOST:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:  # closing: this thread ends after this batch
                    self._queue.put(None)
                    break
                batch.append(more)
            outcomes = self.record([send for send, _, _ in batch])
            for (_, loop, future), outcome in zip(batch, outcomes, strict=True):
                loop.call_soon_threadsafe(_settle, future, outcome)
            # After the answers: it is not part of them. Sent here, not by a thread of its own:
            # that let batches start sooner but smaller, for fewer signals a second
            # (benchmarks/README.md, signals).
            self._wake_for(outcomes)

    def write(self, sends: list[Send]) -> list[Outcome]:
        """Each send's outcome (``record``); the schedulers woken once if any task was
        resumed."""
        outcomes = self.record(sends)
        self._wake_for(outcomes)
        return outcomes

    def _wake_for(self, outcomes: list[Outcome]) -> None:
        if not any(isinstance(o, signals.SentSignal) and o.resumed for o in outcomes):
            return
        try:
            self._wake()  # the scheduler queues them now, not when its wait ends
        except Exception as exc:
            # Recorded and committed: a scheduler's next pass queues them all the same (a lost
            # wake costs a loop, scheduler rule 14), so the sends are not answered with an error
            # that would make their callers send them again.
            log.warning("signals recorded, but the schedulers were not woken: %s", exc)

    def record(self, sends: list[Send]) -> list[Outcome]:
        """Each send's outcome, the batch written in one transaction (or, after a failed
        statement, each in its own)."""
        session = self._sessions()
        try:
            try:
                outcomes = self._in(session, sends)
            except Exception as exc:
                session.rollback()
                if len(sends) == 1:
                    return [exc]
                log.info("a batch of %d signals failed (%s): each sent alone", len(sends), exc)
                outcomes = [self._alone(send) for send in sends]
            else:
                try:
                    session.commit()
                except Exception as exc:
                    return [exc] * len(sends)
        finally:
            session.close()
        return outcomes

    def _alone(self, send: Send) -> Outcome:
        try:
            with self._sessions.begin() as session:
                return self._in(session, [send])[0]
        except Exception as exc:
            return exc

    def _in(self, session: Session, sends: list[Send]) -> list[Outcome]:
        revoked: set[int] = set()
        while True:
            try:
                return self._written(session, sends, revoked)
            except tokens.Gone as gone:  # found by the first statement: nothing else done yet
                session.rollback()
                revoked |= gone.ids

    def _written(self, session: Session, sends: list[Send], revoked: set[int]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(sends)
        plain: list[int] = []
        ready: list[signals.Outgoing] = []
        for n, send in enumerate(sends):
            if send.token_id is not None and send.token_id in revoked:
                outcomes[n] = tokens.Revoked()
            elif send.idempotency_key is None:
                try:
                    ready.append(
                        signals.outgoing(self._cipher, send.key, send.payload, send.sender)
                    )
                    plain.append(n)
                except signals.SignalError as exc:  # refused before writing anything
                    outcomes[n] = exc
        going = [s for s, o in zip(sends, outcomes, strict=True) if o is None]
        # A key of a send refused since is locked too: one statement, and a lock held for
        # nothing is released at the commit.
        prelude = tokens.checked_and_locking(
            {s.token_id for s in going if s.token_id is not None}, [s.key for s in sends]
        )
        for n, sent in zip(
            plain, signals.send_many_in(session, self._cipher, ready, prelude), strict=True
        ):
            outcomes[n] = sent
        for n, send in enumerate(sends):
            if outcomes[n] is None:
                outcomes[n] = self._idempotent(session, send)
        return [o for o in outcomes if o is not None]

    def _idempotent(self, session: Session, send: Send) -> Outcome:
        try:
            return signals.send_in(
                session,
                self._cipher,
                send.key,
                send.payload,
                send.sender,
                send.idempotency_key,
                key_locked=True,
            )
        # Refused before writing anything (its payload, its key; its idempotency key's claim
        # held by another send): the transaction goes on for the others.
        except (signals.SignalError, signals.IdempotencyConflict) as exc:
            return exc
