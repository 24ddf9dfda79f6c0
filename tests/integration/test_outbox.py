"""Transactional outbox against real Postgres and Redis: stage in the transaction, flush after
commit, and the relay that publishes rows a crashed process left behind."""

from __future__ import annotations

import datetime as dt
import threading

from sqlalchemy import Connection, event, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from broker import outbox
from broker.client import Broker
from broker.streams import QueueMessage, to_fields
from deferral.store.tables import Outbox

NOW = dt.timedelta(seconds=-1)  # "older than" cut-off in the future: every row is old enough


def _message(n: int) -> QueueMessage:
    return QueueMessage(task_instance_id=str(n), try_number="1", task=f"d.r.t{n}", mac="m")


def _b(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def _commit_unflushed(
    sessions: sessionmaker[Session], stream: str, numbers: range | list[int]
) -> list[int]:
    """Stage and commit rows but never flush them: a process that died right after commit."""
    with sessions.begin() as session:
        rows = [outbox.stage(session, stream, _message(n)) for n in numbers]
        session.flush()
        return [row.id for row in rows]


def _published(sessions: sessionmaker[Session]) -> dict[int, bool]:
    with sessions() as session:
        return {
            row.id: row.published_at is not None
            for row in session.scalars(select(Outbox).order_by(Outbox.id))
        }


def _age(sessions: sessionmaker[Session], ids: list[int], by: dt.timedelta) -> None:
    with sessions.begin() as session:
        session.execute(
            update(Outbox).where(Outbox.id.in_(ids)).values(created_at=Outbox.created_at - by)
        )


def test_stage_then_flush_publishes_and_marks(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    stream = broker.keys.queue("default")
    messages = [_message(1), _message(2)]
    with sessions.begin() as session:
        staged = [outbox.stage(session, stream, m) for m in messages]
        # Nothing is published before commit.
        assert broker.redis.xlen(stream) == 0
    assert broker.redis.xlen(stream) == 0
    assert _published(sessions) == {staged[0].id: False, staged[1].id: False}

    outbox.flush(sessions, broker, staged)

    assert [e.fields for e in broker.xrange(stream)] == [_b(to_fields(m)) for m in messages]
    assert _published(sessions) == {staged[0].id: True, staged[1].id: True}
    with sessions() as session:
        row = session.get(Outbox, staged[0].id)
        assert row is not None
        assert row.stream == stream
        assert row.fields == to_fields(messages[0])
        assert row.published_at is not None and row.published_at >= row.created_at
    # Published rows are not relayed again.
    assert outbox.relay(sessions, broker, NOW) == 0
    assert broker.redis.xlen(stream) == 2


def test_flush_nothing_is_a_no_op(sessions: sessionmaker[Session], broker: Broker) -> None:
    outbox.flush(sessions, broker, [])
    keys = set(broker.redis.scan_iter(match=f"{broker.keys.prefix}:*"))
    assert keys <= {broker.keys.shard_count.encode()}  # at most the recorded shard count


def test_rolled_back_row_is_never_published(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    stream = broker.keys.queue("default")
    with sessions() as session:
        session.begin()
        outbox.stage(session, stream, _message(1))
        session.flush()  # the INSERT was sent ...
        session.rollback()  # ... and undone
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Outbox)) == 0

    assert outbox.relay(sessions, broker, NOW) == 0
    assert broker.redis.exists(stream) == 0


def test_relay_publishes_only_rows_older_than_cutoff(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    stream = broker.keys.queue("default")
    old_ids = _commit_unflushed(sessions, stream, [1, 2])
    new_ids = _commit_unflushed(sessions, stream, [3])
    _age(sessions, old_ids, dt.timedelta(hours=1))

    assert outbox.relay(sessions, broker, dt.timedelta(minutes=10)) == 2
    assert [e.fields for e in broker.xrange(stream)] == [_b(to_fields(_message(n))) for n in (1, 2)]
    assert _published(sessions) == {old_ids[0]: True, old_ids[1]: True, new_ids[0]: False}

    # A second relay has nothing more to publish.
    assert outbox.relay(sessions, broker, dt.timedelta(minutes=10)) == 0
    assert broker.redis.xlen(stream) == 2

    # Once the young row is old enough, it goes too, exactly once.
    assert outbox.relay(sessions, broker, NOW) == 1
    assert outbox.relay(sessions, broker, NOW) == 0
    assert [e.fields for e in broker.xrange(stream)][-1] == _b(to_fields(_message(3)))
    assert broker.redis.xlen(stream) == 3
    assert all(_published(sessions).values())


def test_relay_respects_limit_and_order(sessions: sessionmaker[Session], broker: Broker) -> None:
    stream = broker.keys.queue("default")
    _commit_unflushed(sessions, stream, range(5))
    assert outbox.relay(sessions, broker, NOW, limit=3) == 3
    assert outbox.relay(sessions, broker, NOW, limit=3) == 2
    assert outbox.relay(sessions, broker, NOW, limit=3) == 0
    assert [e.fields[b"task_instance_id"] for e in broker.xrange(stream)] == [
        str(n).encode() for n in range(5)
    ]


def test_relay_to_several_streams(sessions: sessionmaker[Session], broker: Broker) -> None:
    a, b = broker.keys.queue("a"), broker.keys.queue("b")
    _commit_unflushed(sessions, a, [1])
    _commit_unflushed(sessions, b, [2, 3])
    assert outbox.relay(sessions, broker, NOW) == 3
    assert broker.redis.xlen(a) == 1
    assert broker.redis.xlen(b) == 2


def test_concurrent_relays_do_not_publish_twice(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    stream = broker.keys.queue("default")
    total = 300
    _commit_unflushed(sessions, stream, range(total))

    start = threading.Barrier(2)
    counts: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        mine = 0
        try:
            start.wait(timeout=10)
            while n := outbox.relay(sessions, broker, NOW, limit=25):
                mine += n
        except BaseException as exc:  # pragma: no cover - reported below
            with lock:
                errors.append(exc)
        with lock:
            counts.append(mine)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert len(counts) == 2
    # Anything a relay skipped because the other held it locked is picked up by a final pass.
    counts.append(outbox.relay(sessions, broker, NOW))

    assert sum(counts) == total
    assert broker.redis.xlen(stream) == total
    ids = [e.fields[b"task_instance_id"] for e in broker.xrange(stream)]
    assert len(set(ids)) == total
    with sessions() as session:
        unpublished = session.scalar(text("SELECT count(*) FROM outbox WHERE published_at IS NULL"))
    assert unpublished == 0


def test_relay_skips_rows_locked_by_another_transaction(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    """A row held FOR UPDATE (e.g. by a relay mid-publish) is skipped, not waited for."""
    stream = broker.keys.queue("default")
    ids = _commit_unflushed(sessions, stream, [1, 2])
    relayed: list[int] = []
    with sessions.begin() as holder:
        holder.execute(select(Outbox).where(Outbox.id == ids[0]).with_for_update())
        # Another connection, while the lock is held: it must skip the row, not wait for it.
        worker = threading.Thread(
            target=lambda: relayed.append(outbox.relay(sessions, broker, NOW)), daemon=True
        )
        worker.start()
        worker.join(timeout=5)
        blocked = worker.is_alive()
    worker.join(timeout=5)  # the lock is released now, so a blocked relay finishes
    assert not blocked, "relay waited for a locked row instead of skipping it"
    assert relayed == [1]
    assert [e.fields[b"task_instance_id"] for e in broker.xrange(stream)] == [b"2"]
    assert outbox.relay(sessions, broker, NOW) == 1
    assert broker.redis.xlen(stream) == 2


def test_a_batch_writes_a_row_per_stream_and_publishes_every_entry_in_order(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    a, b = broker.keys.queue("a"), broker.keys.queue("b")
    items = [(a, _message(1)), (b, _message(2)), (a, _message(3)), (a, _message(4))]
    with sessions.begin() as session:
        staged = outbox.stage_many(session, items)
    assert [(entry.stream, entry.fields) for entry in staged] == [
        (stream, to_fields(m)) for stream, m in items
    ]
    with sessions() as session:
        rows = {row.stream: row for row in session.scalars(select(Outbox))}
    assert sorted(rows) == sorted([a, b])
    assert rows[a].fields == to_fields(_message(1))
    assert rows[a].more_fields == [to_fields(_message(3)), to_fields(_message(4))]
    assert rows[b].more_fields is None

    outbox.flush(sessions, broker, staged)

    assert [e.fields for e in broker.xrange(a)] == [_b(to_fields(_message(n))) for n in (1, 3, 4)]
    assert [e.fields for e in broker.xrange(b)] == [_b(to_fields(_message(2)))]
    assert _published(sessions) == {rows[a].id: True, rows[b].id: True}


def test_relay_publishes_every_entry_of_a_row_a_crashed_process_left(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    stream = broker.keys.queue("default")
    with sessions.begin() as session:  # committed, never flushed: the process died
        outbox.stage_many(session, [(stream, _message(n)) for n in (1, 2, 3)])

    assert outbox.relay(sessions, broker, NOW) == 1
    assert [e.fields for e in broker.xrange(stream)] == [
        _b(to_fields(_message(n))) for n in (1, 2, 3)
    ]
    assert all(_published(sessions).values())
    assert outbox.relay(sessions, broker, NOW) == 0


def test_the_mark_of_published_rows_is_one_statement_committed_on_its_own(
    sessions: sessionmaker[Session], broker: Broker
) -> None:
    """No BEGIN and COMMIT round trips around it, and no wait for its WAL flush: a lost mark
    only publishes the row again."""
    engine = sessions.kw["bind"]
    marks: list[tuple[bool, str]] = []

    def seen(conn: Connection, cursor: object, statement: str, *args: object) -> None:
        if "UPDATE outbox SET published_at" in statement:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            marks.append((dbapi.autocommit, statement))

    with sessions.begin() as session:
        staged = [outbox.stage(session, broker.keys.queue("default"), _message(1))]
        before = session.scalar(text("SHOW synchronous_commit"))  # the test database's own
    event.listen(engine, "before_cursor_execute", seen)
    try:
        outbox.flush(sessions, broker, staged)
    finally:
        event.remove(engine, "before_cursor_execute", seen)

    ((autocommit, statement),) = marks
    assert autocommit
    assert "set_config('synchronous_commit', 'off', true)" in statement
    assert _published(sessions) == {staged[0].id: True}
    with sessions() as session:  # the setting was the mark's transaction's only
        assert session.scalar(text("SHOW synchronous_commit")) == before
