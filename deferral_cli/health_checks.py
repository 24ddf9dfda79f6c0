"""``deferral health``: whether a process's prerequisites answer and, for a named scheduler,
worker or triggerer, whether it heartbeats (for the web UI: whether its health page answers),
as pure decisions on what the command gathered.

A container healthcheck runs it next to the process it checks: Postgres and Redis must answer,
and the process's own row must be alive by :func:`deferral.store.liveness.is_alive`, the one rule
for
that. A process that is up but stuck stops heartbeating, so it turns unhealthy too.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from deferral.store import liveness
from deferral.store.doctor import Check, Status
from deferral.store.tables import Scheduler, Triggerer, Worker

# The process kinds that heartbeat a row of their own, by the name `--service` takes.
PROCESSES: dict[str, liveness.Process] = {
    "scheduler": Scheduler,
    "worker": Worker,
    "triggerer": Triggerer,
}


@dataclass(frozen=True)
class Beat:
    """A process's row: its state and latest heartbeat (the database's clock)."""

    state: str
    latest_heartbeat: dt.datetime


def server(name: str, where: str, error: str | None) -> Check:
    """``name`` (postgres, redis) at ``where`` answered, or failed with ``error``."""
    if error is None:
        return Check(Status.OK, name, f"answers at {where}")
    return Check(Status.FAIL, name, f"no answer at {where}: {error}")


def heartbeat(
    service: str, name: str, beat: Beat | None, now: dt.datetime, heartbeat_sec: float
) -> Check:
    """Whether the ``service`` process called ``name`` is alive, by its row."""
    label = f"{service} {name}"
    if beat is None:
        return Check(
            Status.FAIL,
            label,
            "no heartbeat recorded (not started yet, or started under another --name)",
        )
    age = max(0.0, (now - beat.latest_heartbeat).total_seconds())
    if liveness.is_alive(beat.state, beat.latest_heartbeat, now, heartbeat_sec):
        return Check(Status.OK, label, f"{beat.state}, heartbeat {age:.1f}s ago")
    if beat.state != liveness.RUNNING:
        return Check(Status.FAIL, label, f"{beat.state} (heartbeat {age:.1f}s ago)")
    limit = liveness.stale_after_sec(heartbeat_sec)
    return Check(
        Status.FAIL,
        label,
        f"heartbeat {age:.1f}s ago, older than {limit:g}s"
        f" (2.1 x DEFERRAL_HEARTBEAT_SEC={heartbeat_sec:g}): stuck or gone",
    )


# The web UI has no row of its own: it is healthy when its health page answers.
WEBSERVER = "webserver"
WEBSERVER_HEALTH_PATH = "/api/v1/health"


def webserver_url(host: str, port: int) -> str:
    """Where a healthcheck next to ``deferral webserver --host HOST --port PORT`` asks: the
    loopback address when it listens on every address."""
    probe = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    where = f"[{probe}]" if ":" in probe else probe
    return f"http://{where}:{port}{WEBSERVER_HEALTH_PATH}"


def webserver(url: str, error: str | None) -> Check:
    if error is None:
        return Check(Status.OK, WEBSERVER, f"answers at {url}")
    return Check(Status.FAIL, WEBSERVER, f"no answer at {url}: {error}")
