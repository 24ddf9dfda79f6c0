"""What every benchmark shares: a throw-away deployment of real service processes.

:class:`Stack` creates a fresh database (migrated to head), a stream prefix of its own, a DAGs
folder and a Fernet key, starts ``scheduler``/``worker``/``triggerer consume`` as subprocesses of
the installed console scripts (each logging to a file of its own), and on the way out stops them,
drops the database and deletes every key under the prefix. The servers are those the tests use:
``DEFERRAL_TEST_ADMIN_URL`` / ``DEFERRAL_TEST_REDIS_URL``, else the local ones.

Benchmarks are scripts, run on demand (``.venv/bin/python benchmarks/<name>.py --help``); pytest
never collects them (its ``testpaths`` is ``tests``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# The test helpers (servers, service processes, polling) serve here too: run from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.fernet import Fernet
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.replies import PendingSummary, parse_xreadgroup
from broker.streams import GROUP_TRIGGERERS, to_fields, trigger_message
from deferral.runtime.crypto import Cipher
from deferral.runtime.serialization import check_kwargs
from deferral.store import migrate, transitions
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import TaskInstance, TaskStateChange
from deferral.triggers import DateTimeTrigger
from deferral.triggers.base import classpath_of
from tests.e2e.conftest import BIN, Services, command
from tests.helpers import wait_for
from tests.outage_runs import reached
from tests.servers import ADMIN_URL, REDIS_URL

__all__ = ["wait_for"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} cores)"


@dataclass(frozen=True)
class Figure:
    """One measured figure and its target; ``at_most`` says which side of the target is good."""

    label: str
    value: float
    unit: str
    target: float | None = None
    at_most: bool = True

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value <= self.target if self.at_most else self.value >= self.target

    def line(self) -> str:
        shown = f"{self.value:,.1f}" if self.value < 100 else f"{self.value:,.0f}"
        text_ = f"  {self.label}: {shown} {self.unit}"
        if self.target is not None:
            side = "<=" if self.at_most else ">="
            verdict = "met" if self.met else "MISSED"
            text_ += f"   (target {side} {self.target:,g} {self.unit}: {verdict})"
        return text_


def calibration(seconds: float = 1.0) -> str:
    """How fast this machine is right now, to read the figures beside: commits a second of one
    client on the test server (each assigns a transaction id, so its commit is flushed as a
    one-row insert's is), and a pure-Python loop's iterations a second."""
    engine = create_engine(ADMIN_URL, pool_size=1)
    with engine.connect() as conn:
        commits, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.execute(text("SELECT pg_current_xact_id()"))
            conn.commit()
            commits += 1
    engine.dispose()
    loops, total, deadline = 0, 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for i in range(10_000):
            total += i
        loops += 10_000
    return (
        f"calibration: {commits / seconds:,.0f} single-row commits/s (one client),"
        f" {loops / seconds / 1e6:,.1f} M Python loop iterations/s"
    )


def report(title: str, figures: Iterable[Figure], notes: Iterable[str] = ()) -> bool:
    """Print the figures with their targets, the load average and the calibration line; return
    whether all were met."""
    figures = list(figures)
    print(f"\n{title}")
    print(f"  measured at {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {load_average()}")
    print(f"  {calibration()}")
    for note in notes:
        print(f"  {note}")
    for figure in figures:
        print(figure.line())
    return all(f.met is not False for f in figures)


def add_service_arguments(parser: argparse.ArgumentParser, concurrency: int) -> None:
    """The options every latency benchmark takes: its workers, their slots, keeping the logs."""
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=concurrency, help="slots per worker")
    parser.add_argument("--keep-logs", action="store_true")


class Stack:
    """A fresh database and stream prefix, and the service processes started on them."""

    def __init__(
        self,
        *,
        heartbeat_sec: float = 5.0,
        keep: bool = False,
        max_map_length: int = 1024,
        redis_url: str = REDIS_URL,
        stream_shards: int | None = None,
        extra_env: dict[str, str] | None = None,
        prefix: str = "deferral_bench",
        admin_url: str = ADMIN_URL,
    ) -> None:
        """``extra_env``: more DEFERRAL_* settings for every service started; ``prefix``: of
        the database's and stream prefix's name; ``admin_url``: the server the database is made
        on (a private one, for a benchmark that stops it)."""
        self.name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        self.redis_url = redis_url
        self.stream_shards = stream_shards  # None: the URL's default
        self.keep = keep
        self.home = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.dags = self.home / "dags"
        self.logs = self.home / "logs"
        self.dags.mkdir()
        self.logs.mkdir()
        self.url = make_url(admin_url).set(database=self.name).render_as_string(False)
        env = {
            "DEFERRAL_DATABASE_URL": self.url,
            "DEFERRAL_REDIS_URL": redis_url,
            "DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(),
            "DEFERRAL_DAGS_FOLDER": str(self.dags),
            "DEFERRAL_STREAM_PREFIX": self.name,
            "DEFERRAL_HEARTBEAT_SEC": f"{heartbeat_sec:g}",
            "DEFERRAL_MAX_MAP_LENGTH": str(max_map_length),
        }
        if stream_shards is not None:
            env["DEFERRAL_STREAM_SHARDS"] = str(stream_shards)
        env.update(extra_env or {})
        self.env = {**os.environ, **env}
        self.services = Services(env, self.logs)
        self._started_at: dict[str, int] = {}  # log offset of each process's latest start
        self._admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
        self.sessions: sessionmaker[Session]
        self.broker: Broker

    def __enter__(self) -> Stack:
        # SIGTERM (a timeout, Ctrl-C's cousin) unwinds through __exit__: nothing is left behind.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        migrate.upgrade(self.url)
        # Pre-ping: the checks outlive a server restart some benchmarks make.
        self.sessions = make_sessionmaker(make_engine(self.url, pool_size=2, pool_pre_ping=True))
        self.broker = Broker.from_url(self.redis_url, self.name, shards=self.stream_shards)
        return self

    def vacuum_analyze(self) -> None:
        """VACUUM ANALYZE the stack's database: after a bulk load, so that what is measured next
        is the steady state, not autovacuum catching up (it runs at a moment of its choosing,
        for seconds, on one of the two cores)."""
        engine = make_engine(self.url, pool_size=1).execution_options(isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text("VACUUM ANALYZE"))
        engine.dispose()

    def __exit__(self, *exc: object) -> None:
        """Stop the processes; drop the database, the keys and the files, unless ``keep``
        (a failed round is looked into with all three)."""
        self.services.stop_all()
        self.sessions.kw["bind"].dispose()
        if self.keep:
            self._admin.dispose()
            self.broker.close()
            print(f"kept: logs in {self.logs}, database {self.name}, keys {self.name}:*")
            return
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self._admin.dispose()
        keys = list(self.broker.redis.scan_iter(match=f"{self.name}:*", count=1000))
        for start in range(0, len(keys), 1000):
            self.broker.redis.delete(*keys[start : start + 1000])
        self.broker.close()
        shutil.rmtree(self.home, ignore_errors=True)

    # -- processes -------------------------------------------------------------------------------

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        return self.services.procs

    def start(
        self, name: str, *args: str, program: Sequence[str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``<service> consume --name <name> [args]``; the service is ``name`` without its
        trailing digits (worker2 is a worker), unless ``program`` replaces ``<service>
        consume``. A name started again appends to its log."""
        service = name.rstrip("0123456789")
        program = command(service, "consume") if program is None else list(program)
        log = self.logs / f"{name}.log"
        self._started_at[name] = log.stat().st_size if log.exists() else 0
        return self.services.spawn(name, [*program, "--name", name, *args], self.services.env)

    def signal(self, name: str, signum: signal.Signals) -> None:
        self.procs[name].send_signal(signum)
        if signum == signal.SIGKILL:
            self.procs[name].wait()

    def log(self, name: str, *, latest: bool = False) -> str:
        """What ``name`` logged (``latest``: since it was last started)."""
        with (self.logs / f"{name}.log").open("rb") as log:
            if latest:
                log.seek(self._started_at[name])
            return log.read().decode(errors="replace")

    def wait_started(self, *names: str, timeout: float = 120.0) -> None:
        """Until each named service logged that it started (workers warm their children first)."""
        for name in names:
            wait_for(
                lambda name=name: self.started(name),  # type: ignore[misc]
                timeout=timeout,
                what=f"{name} to start",
            )

    def started(self, name: str) -> bool:
        """Whether the service ``name`` logged that it started since its latest start (the
        benchmark ends if it exited)."""
        said = {"scheduler": " started", "worker": " consuming ", "triggerer": " consuming "}
        return said[name.rstrip("0123456789")] in self.log(name, latest=True) or self._died(name)

    def _died(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            raise SystemExit(f"benchmark: {name} exited:\n{self.log(name)[-3000:]}")
        return False

    # -- DAGs and runs ---------------------------------------------------------------------------

    def write_dag(self, module: str, source: str) -> None:
        (self.dags / f"{module}.py").write_text(source)

    def trigger(self, dag_id: str, run_ids: Iterable[str]) -> None:
        """Create queued runs of ``dag_id`` (one transaction, a microsecond apart: a logical
        date is unique per DAG); the scheduler starts them."""
        now = dt.datetime.now(dt.UTC)
        with self.sessions.begin() as session:
            for i, run_id in enumerate(run_ids):
                logical_date = now + dt.timedelta(microseconds=i)
                transitions.create_dag_run(session, dag_id, run_id, logical_date, {})

    def seed_time_triggers(self, n: int, moment: dt.datetime, spread: dt.timedelta) -> None:
        """``n`` deferred task instances of one running run, each waiting on a DateTimeTrigger
        between ``moment`` and ``moment + spread``, as a worker would have left them (trigger
        rows, deferred tasks, trigger entries sealed like the worker's), without a worker:
        for benchmarks of the triggerer alone. Written in set-based statements and pipelined
        publishes, so 100,000 take seconds."""
        cipher = Cipher(self.env["DEFERRAL_FERNET_KEY"].split(","))
        classpath = classpath_of(DateTimeTrigger)
        moments = [moment + spread * (i / max(n - 1, 1)) for i in range(n)]
        with self.sessions.begin() as session:
            session.execute(
                text(
                    "INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date)"
                    " VALUES ('bench_seeded', 'seeded', now(), 'running', now())"
                )
            )
            trigger_ids = list(
                session.scalars(
                    text(
                        "INSERT INTO trigger (classpath, kwargs)"
                        " SELECT :classpath, '' FROM generate_series(1, :n) AS i"
                        " RETURNING id"
                    ),
                    {"classpath": classpath, "n": n},
                )
            )
            ti_ids = list(
                session.scalars(
                    text(
                        "INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number,"
                        " trigger_id, next_method, start_date, first_started_at)"
                        " SELECT 'bench_seeded', 'seeded', 't' || t.ord, 'deferred', 1, t.id,"
                        " 'resume', now(), now()"
                        " FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY AS t(id, ord)"
                        " ORDER BY t.ord RETURNING id"
                    ),
                    {"ids": trigger_ids},
                )
            )
        items = []
        seeded = zip(trigger_ids, ti_ids, moments, strict=True)
        for n, (trigger_id, ti_id, at) in enumerate(seeded, 1):
            message = trigger_message(
                cipher,
                trigger_id=trigger_id,
                classpath=classpath,
                kwargs=check_kwargs({"moment": at}),
                task_instance_id=ti_id,
                try_number=1,
                task=f"bench_seeded.seeded.t{n}",  # as the checks against PostgreSQL want
            )
            stream = self.broker.keys.trigger_stream("default", trigger_id)
            items.append((stream, to_fields(message)))
        for start in range(0, len(items), 5000):
            self.broker.publish_many(items[start : start + 5000])

    def set_pool_slots(self, pool: str, slots: int) -> None:
        with self.sessions.begin() as session:
            session.execute(
                text("UPDATE pool SET slots = :slots WHERE name = :pool"),
                {"slots": slots, "pool": pool},
            )

    def pending_triggers(self) -> PendingSummary:
        """Trigger entries delivered to triggerers and not yet retired, per triggerer (in every
        shard of the default queue's triggers streams)."""
        count, per_consumer = 0, Counter[str]()
        for stream in self.broker.keys.triggers_of("default"):
            try:
                pending = self.broker.pending(stream, GROUP_TRIGGERERS)
            except ResponseError:
                continue  # no stream or group yet
            count += pending.count
            per_consumer.update(pending.per_consumer)
        return PendingSummary(count, dict(per_consumer))

    def reached(self, state: str, dag_id: str) -> int:
        """How many of ``dag_id``'s task instances have been in ``state`` at some point."""
        return reached(self.sessions, state, dag_id)

    def run_state(self, dag_id: str, run_id: str) -> str | None:
        with self.sessions() as session:
            return session.scalar(
                text("SELECT state FROM dag_run WHERE dag_id = :dag_id AND run_id = :run_id"),
                {"dag_id": dag_id, "run_id": run_id},
            )

    def warm_up(self, dag_id: str) -> None:
        """Run ``dag_id`` once (run id ``warm-up``) to its success: the first imports and
        connections of every service are paid before anything is timed."""
        self.trigger(dag_id, ["warm-up"])
        wait_for(
            lambda: self.run_state(dag_id, "warm-up") == "success",
            timeout=120,
            what=f"the warm-up run of {dag_id}",
        )

    def finished_runs(self, dag_id: str) -> int:
        with self.sessions() as session:
            return int(
                session.scalar(
                    text(
                        "SELECT count(*) FROM dag_run WHERE dag_id = :dag_id"
                        " AND state IN ('success', 'failed')"
                    ),
                    {"dag_id": dag_id},
                )
                or 0
            )

    def trigger_rows(self) -> int:
        """How many trigger rows there are (tasks on one shared trigger share one)."""
        with self.sessions() as session:
            return int(session.scalar(text("SELECT count(*) FROM trigger")) or 0)

    def published_trigger_rows(self) -> int:
        """How many trigger rows have had their entry published (far timers waiting as rows,
        deferral.store.far_timers, have not)."""
        with self.sessions() as session:
            return int(
                session.scalar(text("SELECT count(*) FROM trigger WHERE far_moment IS NULL")) or 0
            )

    def states(self) -> dict[str, int]:
        """How many task instances are in each state."""
        with self.sessions() as session:
            return dict(
                session.execute(
                    text("SELECT state, count(*) FROM task_instance GROUP BY state")
                ).all()
            )

    def changes(self, dag_id: str | None = None) -> list[Change]:
        """Every recorded state change (of ``dag_id``'s task instances), oldest first."""
        query = (
            select(
                TaskStateChange.task_instance_id,
                TaskStateChange.from_state,
                TaskStateChange.to_state,
                TaskStateChange.reason,
                TaskStateChange.at,
            )
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .order_by(TaskStateChange.id)
        )
        if dag_id is not None:
            query = query.where(TaskInstance.dag_id == dag_id)
        with self.sessions() as session:
            return [Change(*row) for row in session.execute(query)]


@dataclass(frozen=True)
class Change:
    task_instance_id: int
    from_state: str
    to_state: str
    reason: str | None
    at: dt.datetime


def resumed_by_trigger(change: Change) -> bool:
    """deferred -> scheduled because the trigger fired (not a timeout or a user)."""
    return (
        change.from_state == "deferred"
        and change.to_state == "scheduled"
        and (change.reason or "").startswith(transitions.RESUMED_BY_TRIGGER)
    )


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


class CpuMeter:
    """CPU seconds used by each service (its task processes included) and by the Postgres
    backends of the stack's database between :meth:`start` and :meth:`stop`: where the time
    goes, process by process."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.before: dict[str, dict[int, float]] = {}
        self.used: dict[str, float] = {}

    def _sample(self) -> dict[str, dict[int, float]]:
        sample: dict[str, dict[int, float]] = {}
        for name, proc in self.stack.procs.items():
            pids = [proc.pid, *_children_of(proc.pid)]
            sample[name] = {pid: _cpu_seconds(pid) for pid in pids}
        with self.stack.sessions() as session:
            backends = session.scalars(
                text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
            ).all()
        sample["postgres"] = {pid: _cpu_seconds(pid) for pid in backends}
        return sample

    def start(self) -> None:
        self.before = self._sample()

    def stop(self) -> dict[str, float]:
        after = self._sample()
        self.used = {
            name: sum(t - self.before.get(name, {}).get(pid, 0.0) for pid, t in pids.items())
            for name, pids in after.items()
        }
        return self.used

    def lines(self, per: int, what: str) -> list[str]:
        total = sum(self.used.values())
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(self.used.items()))
        return [
            f"CPU seconds: {parts} (total {total:.1f}: {total * 1000 / max(per, 1):.2f} ms per"
            f" {what}; Redis and other databases not counted)"
        ]


class RedisMeter:
    """CPU seconds and commands of each Redis primary between :meth:`start` and :meth:`stop`
    (``INFO``: used_cpu_sys + used_cpu_user, total_commands_processed): what one deferral costs
    Redis, node by node. Everything the server did counts: on a shared Redis, other clients'
    work too (a cluster started for the run has only the stack's)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.before: dict[str, tuple[float, int]] = {}
        self.used: dict[str, tuple[float, int]] = {}

    def _sample(self) -> dict[str, tuple[float, int]]:
        client = self.stack.broker.redis
        if isinstance(client, RedisCluster):
            infos = client.info(target_nodes=RedisCluster.PRIMARIES)
        else:
            infos = {"redis": client.info()}
        return {
            str(node): (
                float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                int(info["total_commands_processed"]),
            )
            for node, info in infos.items()
        }

    def start(self) -> None:
        self.before = self._sample()

    def stop(self) -> None:
        after = self._sample()
        self.used = {
            node: (cpu - self.before.get(node, (cpu, n))[0], n - self.before.get(node, (cpu, n))[1])
            for node, (cpu, n) in after.items()
        }

    def lines(self, per: int, what: str) -> list[str]:
        per = max(per, 1)
        parts = ", ".join(
            f"{node} {cpu * 1000 / per:.3f} ms / {n / per:.1f} commands"
            for node, (cpu, n) in sorted(self.used.items())
        )
        return [f"Redis per {what}: {parts}"]


@dataclass(frozen=True)
class RowCounts:
    """PostgreSQL's counters of the stack's database at one moment: rows written (in total and
    per table), commits, and the server's WAL position (shared with every database on it)."""

    commits: int
    inserted: int
    updated: int
    deleted: int
    wal_lsn: int
    per_table: dict[str, tuple[int, int, int]]


class RowMeter:
    """Rows inserted / updated / deleted, commits and WAL bytes between :meth:`start` and
    :meth:`stop`, from ``pg_stat_database`` / ``pg_stat_user_tables`` and
    ``pg_current_wal_lsn()``: what PostgreSQL writes per task. A backend reports its counters
    at most once a second, and an idle one within 10 s, so :meth:`stop` waits until two samples
    a second apart agree (or 12 s); ``settle=False`` when the phase ended long enough ago. WAL is
    the whole server's: other databases' writes count."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.before: RowCounts | None = None
        self.after: RowCounts | None = None

    def _sample(self) -> RowCounts:
        with self.stack.sessions() as session:
            session.execute(text("SELECT pg_stat_clear_snapshot()"))
            commits, inserted, updated, deleted, lsn = session.execute(
                text(
                    "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted,"
                    " pg_current_wal_lsn() - '0/0'::pg_lsn"
                    " FROM pg_stat_database WHERE datname = current_database()"
                )
            ).one()
            # A partition's rows count as its table's (the history tables are partitioned).
            tables = session.execute(
                text(
                    "SELECT coalesce(p.relname, s.relname), sum(s.n_tup_ins), sum(s.n_tup_upd),"
                    " sum(s.n_tup_del) FROM pg_stat_user_tables s"
                    " LEFT JOIN pg_inherits i ON i.inhrelid = s.relid"
                    " LEFT JOIN pg_class p ON p.oid = i.inhparent"
                    " GROUP BY 1"
                )
            ).all()
        return RowCounts(
            commits=int(commits),
            inserted=int(inserted),
            updated=int(updated),
            deleted=int(deleted),
            wal_lsn=int(lsn),
            per_table={name: (int(i), int(u), int(d)) for name, i, u, d in tables},
        )

    def start(self) -> None:
        self.before = self._sample()

    def stop(self, *, settle: bool = True) -> None:
        previous = self._sample()
        deadline = time.monotonic() + (12 if settle else 0)
        while time.monotonic() < deadline:
            time.sleep(1)  # a backend's reporting interval: what is waited for is the counters
            current = self._sample()
            settled = (current.inserted, current.updated, current.deleted) == (
                previous.inserted,
                previous.updated,
                previous.deleted,
            )
            previous = current
            if settled:
                break
        self.after = previous

    def lines(self, per: int, what: str) -> list[str]:
        before, after = self.before, self.after
        assert before is not None and after is not None, "start() and stop() first"
        per = max(per, 1)
        tables = []
        for name, (ins, upd, dele) in sorted(after.per_table.items()):
            was = before.per_table.get(name, (0, 0, 0))
            counts = (ins - was[0], upd - was[1], dele - was[2])
            if any(counts):
                tables.append(
                    f"{name} {counts[0] / per:.2f}/{counts[1] / per:.2f}/{counts[2] / per:.2f}"
                )
        inserted = (after.inserted - before.inserted) / per
        updated = (after.updated - before.updated) / per
        deleted = (after.deleted - before.deleted) / per
        return [
            f"rows per {what}: {inserted:.2f} inserted, {updated:.2f} updated, {deleted:.2f}"
            f" deleted ({inserted + updated + deleted:.2f} written),"
            f" {(after.commits - before.commits) / per:.2f} commits,"
            f" {(after.wal_lsn - before.wal_lsn) / per / 1024:.1f} KB WAL (server-wide)",
            f"rows per {what} by table (inserted/updated/deleted): {', '.join(tables)}",
        ]


class EventsWatch:
    """When each trigger's event could first be read from the stack's events stream: a plain
    XREAD beside the schedulers' group (it takes nothing from them), so that a resume's latency
    splits into the triggerer's side (moment -> entry readable) and the scheduler's (entry
    readable -> SCHEDULED). Times are this process's clock, the same machine's as Postgres's."""

    def __init__(self, stack: Stack) -> None:
        self.stream = stack.broker.keys.events
        self.seen: dict[int, dt.datetime] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="events-watch", daemon=True)
        # Its own connections; one shard (one Redis): one events stream to watch.
        self._broker = Broker.from_url(stack.redis_url, stack.name, shards=stack.stream_shards)
        # XREAD's raw reply, shaped like XREADGROUP's, which the broker's parser reads.
        self._broker.redis.response_callbacks.pop("XREAD", None)
        self._last = "0-0"

    def __enter__(self) -> EventsWatch:
        # The newest id now, so that nothing published once this returns is missed.
        newest = self._broker.newest(self.stream)
        self._last = newest[0].id if newest else "0-0"
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._broker.close()

    def _read(self) -> None:
        while not self._stop.is_set():
            reply = self._broker.redis.execute_command(
                "XREAD", "BLOCK", 200, "STREAMS", self.stream, self._last
            )
            now = dt.datetime.now(dt.UTC)
            for entry in parse_xreadgroup(reply):
                self._last = entry.id
                trigger_id = entry.fields.get(b"trigger_id")
                if trigger_id is not None:  # a worker's wake entry names no trigger
                    self.seen.setdefault(int(trigger_id), now)


def redis_bytes(stack: Stack) -> int:
    """Bytes Redis holds for the stack's keys (``MEMORY USAGE`` of each key under its prefix,
    every element sampled): what its streams and in-flight indexes cost, whatever other clients
    of a shared Redis hold."""
    client = stack.broker.redis
    total = 0
    for key in client.scan_iter(match=f"{stack.name}:*", count=1000):
        total += int(client.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0") or 0)
    return total


def postgres_bytes(stack: Stack) -> dict[str, int]:
    """Bytes of each table of the stack's database with its indexes and TOAST (a partitioned
    table's partitions counted as it), and ``database`` for the whole database."""
    with stack.sessions() as session:
        sizes = dict(
            session.execute(
                text(
                    "SELECT coalesce(parent.relname, c.relname), sum(pg_total_relation_size(c.oid))"
                    " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " LEFT JOIN pg_inherits i ON i.inhrelid = c.oid"
                    " LEFT JOIN pg_class parent ON parent.oid = i.inhparent"
                    " WHERE n.nspname = 'public' AND c.relkind = 'r' GROUP BY 1"
                )
            ).all()
        )
        sizes["database"] = session.scalar(text("SELECT pg_database_size(current_database())"))
    return {name: int(size) for name, size in sizes.items()}


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(f"benchmark: stopped by signal {signum}")


def rss_kib(pid: int) -> int:
    """Resident set size of a process, KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Profiles:
    """py-spy sampling of running services (their task processes too), for finding where the
    time goes: raw collapsed stacks in the logs folder, summarised by :meth:`summary`."""

    def __init__(
        self, stack: Stack, names: Iterable[str], *, label: str = "", cpu_only: bool = False
    ) -> None:
        """``label`` tells the profiles of several phases apart; ``cpu_only``: sample only
        threads holding the GIL (where CPU goes, not what is waited for)."""
        self.stack = stack
        self.names = list(names)
        self.label = label
        self.cpu_only = cpu_only
        self.spies: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Profiles:
        for name in self.names:
            out = self._path(name)
            pid = str(self.stack.procs[name].pid)
            argv = [str(BIN / "py-spy"), "record", "--format", "raw", "--subprocesses"]
            argv += ["--gil"] if self.cpu_only else []
            self.spies[name] = subprocess.Popen(
                [*argv, "--nonblocking", "--pid", pid, "--output", str(out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for spy in self.spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for spy in self.spies.values():
            spy.wait(timeout=60)

    def _path(self, name: str) -> Path:
        return self.stack.logs / f"{name}{'.' + self.label if self.label else ''}.profile.txt"

    def summary(self, top: int = 12) -> str:
        """Per service: the functions with the most samples on the stack (inclusive) and at its
        top (self), idle waits left out."""
        lines = []
        for name in self.names:
            path = self._path(name)
            if not path.exists():
                continue
            inclusive: dict[str, int] = {}
            own: dict[str, int] = {}
            total = 0
            for line in path.read_text().splitlines():
                stack_text, _, count_text = line.rpartition(" ")
                frames = [
                    f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].split(":")[0].rstrip(")")
                    for f in stack_text.split(";")
                    if f
                ]
                count = int(count_text)
                total += count
                for frame in set(frames):
                    inclusive[frame] = inclusive.get(frame, 0) + count
                if frames:
                    own[frames[-1]] = own.get(frames[-1], 0) + count
            lines.append(f"{name}{' (' + self.label + ')' if self.label else ''}: {total} samples")
            for title, table in (("inclusive", inclusive), ("self", own)):
                lines.append(f"  {title}:")
                for frame, count in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
                    lines.append(f"    {100 * count / max(total, 1):5.1f}%  {frame}")
        return "\n".join(lines)
