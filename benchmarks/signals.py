"""Signals: signal -> SCHEDULED latency with many waiting tasks, and signals per second
through the API.

    .venv/bin/python benchmarks/signals.py [--waiting 10000] [--signals 1000] [--api 2000]
        [--clients 4] [--auth token|basic] [--servers 1]

On a fresh database (see scratch.py): puts ``--waiting`` running tasks into signal waits, each
on a key of its own, through the worker's deferral path (``signals.defer_with_waits``, in
batches of 500); then

- sends ``--signals`` signals one after another with ``deferral.signals.send`` to keys that
  have a waiter, and times each from the call to its commit (the task is SCHEDULED, visible to
  every scheduler, when it returns): p50 / p99, and the CPU the sending process spent;
- starts ``deferral webserver`` and posts ``--api`` signals with ``POST /api/v1/signals/{key}``
  (keep-alive, ``--clients`` threads), half to keys with a waiter, half to keys without:
  signals per second (target: at least 1,000 with 4 clients). ``--auth token`` (the default)
  sends an API token with the ``signals`` scope made by ``webserver.tokens`` (a machine's
  credentials), ``--auth basic`` the admin's HTTP Basic password. The server's signal rate
  limit is lifted for the run. ``--servers N`` starts N webserver replicas (as behind a load
  balancer), client i posting to replica i mod N; the webserver CPU per signal is their sum,
  and PostgreSQL's is that of the database's backends (the same machine shares both); the
  transactions committed in the database per signal (pg_stat_database, read once the
  webservers' connections are closed, so their counts are in).

No scheduler, worker or triggerer runs: nothing but PostgreSQL is needed for a signal to reach
SCHEDULED (queuing it is the scheduler's dispatch, as for any resumed task).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import calibration, load_average
from scratch import scratch_deployment
from sqlalchemy import func, select, text

from deferral import signals
from deferral.runtime import serialization
from deferral.runtime.crypto import Purpose
from deferral.store import transitions
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.metastore import metastore
from deferral.store.tables import DagRun, TaskInstance
from deferral.store.transitions import Attempt, NewTaskInstance
from deferral.triggers import SignalTrigger
from webserver import tokens

WORKER = "bench-worker"
PASSWORD = "bench-password-1234"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def put_waiting(url: str, count: int) -> list[str]:
    """``count`` tasks waiting on keys k0..k<count-1>; returns the keys."""
    sessions = make_sessionmaker(make_engine(url))
    cipher = metastore().cipher
    with sessions.begin() as session:
        transitions.create_dag_run(session, "bench_signals", "r1", dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun)).one()
        transitions.start_dag_run(
            session,
            run,
            [NewTaskInstance(f"t{i}", 0, "default_pool", 1, "default", 1) for i in range(count)],
        )
    keys = []
    for start in range(0, count, 500):
        with sessions.begin() as session:
            ids = list(
                session.scalars(
                    select(TaskInstance.id)
                    .where(TaskInstance.task_id.in_([f"t{i}" for i in range(start, start + 500)]))
                    .order_by(TaskInstance.id)
                )
            )
            transitions.schedule(session, ids)
            transitions.dispatch(session, ids)
            transitions.start_many(session, [(i, 1) for i in ids], "host", WORKER)
        specs, waits = [], {}
        for ti_id in ids:
            key = f"k{ti_id}"
            keys.append(key)
            classpath, kwargs = SignalTrigger(key).serialize()
            jsonable = serialization.check_kwargs(kwargs)
            wait = signals.wait_of(classpath, jsonable, ti_id, 1)
            assert wait is not None
            waits[ti_id] = wait
            specs.append(
                transitions.Deferral(
                    Attempt(ti_id, 1, WORKER),
                    classpath,
                    cipher.encrypt(Purpose.TRIGGER_KWARGS, serialization.encode(jsonable)),
                    "resume",
                    cipher.seal(Purpose.RESUME_KWARGS, {}),
                    None,
                )
            )
        with sessions.begin() as session:
            signals.defer_with_waits(session, cipher, specs, waits)
    with sessions() as session:
        waiting = session.scalar(select(func.count()).where(TaskInstance.state == "deferred"))
    print(f"{waiting} tasks waiting on {len(keys)} keys")
    return keys


def round_trip_baseline(count: int = 200) -> float:
    """p50 of a transaction inserting one signal row and committing, in ms: the floor under
    any signal on this machine at this moment."""
    store = metastore()
    times = []
    with store.sessions() as session:
        for _ in range(count):
            started = time.perf_counter()
            session.execute(text("INSERT INTO signal (key, payload) VALUES ('floor', '')"))
            session.commit()
            times.append((time.perf_counter() - started) * 1000)
        session.execute(text("DELETE FROM signal WHERE key = 'floor'"))
        session.commit()
    return percentile(times, 0.5)


def library_latency(keys: list[str]) -> None:
    floor = round_trip_baseline()
    print(f"baseline: a one-row insert and its commit, p50 {floor:.2f} ms")
    latencies = []
    cpu = time.process_time()
    for key in keys:
        started = time.perf_counter()
        sent = signals.send(key, {"key": key})
        latencies.append((time.perf_counter() - started) * 1000)
        assert len(sent.resumed) == 1, key
    cpu = time.process_time() - cpu
    print(
        f"signal -> SCHEDULED (library, {len(keys)} signals, one at a time): "
        f"p50 {percentile(latencies, 0.5):.2f} ms, p99 {percentile(latencies, 0.99):.2f} ms, "
        f"sender CPU {cpu / len(keys) * 1000:.2f} ms per signal"
    )


def credentials(url: str, auth: str) -> str:
    """The Authorization header's value: a new API token's, or the admin's Basic password."""
    if auth == "basic":
        return "Basic " + base64.b64encode(f"admin:{PASSWORD}".encode()).decode()
    with make_sessionmaker(make_engine(url)).begin() as session:
        token = tokens.create_token(session, metastore().cipher, "bench", [tokens.SIGNALS])
    assert token is not None
    return f"Bearer {token}"


def api_throughput(keys: list[str], clients: int, ports: list[int], authorization: str) -> float:
    headers = {"content-type": "application/json", "authorization": authorization}
    failures: list[str] = []

    def post(part: list[str], port: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for key in part:
            conn.request("POST", f"/api/v1/signals/{key}", json.dumps({"payload": 1}), headers)
            answer = conn.getresponse()
            body = answer.read()
            if answer.status != 201:
                failures.append(f"{key}: {answer.status} {body[:200]!r}")
        conn.close()

    threads = [
        threading.Thread(target=post, args=(keys[i::clients], ports[i % len(ports)]))
        for i in range(clients)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    took = time.perf_counter() - started
    assert not failures, failures[:5]
    rate = len(keys) / took
    print(
        f"API: {len(keys)} signals in {took:.2f} s with {clients} clients:"
        f" {rate:,.0f} signals/s (target >= 1,000)"
    )
    return rate


def cpu_seconds(pid: int) -> float:
    """User and system CPU a process has used (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu(url: str) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend connected to the benchmark's database."""
    engine = make_engine(url)
    with engine.connect() as conn:
        pids = conn.scalars(
            text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        ).all()
    engine.dispose()
    found = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):  # a backend that ended since
            found[pid] = cpu_seconds(pid)
    return found


def commits(url: str) -> int:
    """Transactions committed in the benchmark's database (those of closed connections and
    this one's, at least: an open backend reports its counts at intervals)."""
    engine = make_engine(url)
    with engine.connect() as conn:
        count = conn.scalar(
            text("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        )
    engine.dispose()
    return int(count or 0)


def wait_up(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/api/v1/health")
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the web server did not come up")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--signals", type=int, default=1_000)
    parser.add_argument("--api", type=int, default=2_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--port", type=int, default=18_718)
    parser.add_argument("--auth", choices=("token", "basic"), default="token")
    parser.add_argument(
        "--servers", type=int, default=1, help="webserver replicas; client i posts to i %% N"
    )
    args = parser.parse_args()
    assert args.signals + args.api // 2 <= args.waiting
    print(f"measured at {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {load_average()}")
    print(calibration(), flush=True)
    with tempfile.TemporaryDirectory() as home, scratch_deployment(Path(home), "signals") as url:
        keys = put_waiting(url, args.waiting)
        library_latency(keys[: args.signals])
        with_waiter = keys[args.signals : args.signals + args.api // 2]
        without = [f"nobody-{i}" for i in range(args.api - len(with_waiter))]
        env = {
            **os.environ,
            "DEFERRAL_WEBSERVER_ADMIN_PASSWORD": PASSWORD,
            "DEFERRAL_WEBSERVER_SIGNAL_RATE": "1000000/second",
        }
        ports = [args.port + i for i in range(args.servers)]
        servers = [
            subprocess.Popen(
                [str(Path(sys.executable).with_name("deferral")), "webserver", "--port", str(p)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for p in ports
        ]
        try:
            for port in ports:
                wait_up(port, time.monotonic() + 60)
            authorization = credentials(url, args.auth)
            metastore().sessions.kw["bind"].dispose()  # the library's counts reported
            committed = commits(url)
            cpu = sum(cpu_seconds(server.pid) for server in servers)
            backends = postgres_cpu(url)
            api_throughput(
                [k for pair in zip(with_waiter, without, strict=True) for k in pair],
                args.clients,
                ports,
                authorization,
            )
            cpu = sum(cpu_seconds(server.pid) for server in servers) - cpu
            database = sum(t - backends.get(pid, 0.0) for pid, t in postgres_cpu(url).items())
            print(
                f"webserver CPU {cpu / args.api * 1000:.2f} ms per signal"
                f" ({len(servers)} process(es)), PostgreSQL backends"
                f" {database / args.api * 1000:.2f} ms; {load_average()}"
            )
        finally:
            for server in servers:
                server.terminate()
            for server in servers:
                server.wait(timeout=30)
        committed = commits(url) - committed
        print(f"transactions committed per signal: {committed / args.api:.2f}")


if __name__ == "__main__":
    main()
