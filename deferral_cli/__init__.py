"""The ``deferral`` command: database, DAGs, runs, and a standalone mode for trying it out.

Each subcommand's module is imported when that subcommand runs (``COMMANDS``), so
``deferral --version`` and ``deferral --help`` start at once and ``deferral dags list`` loads
what listing DAGs needs and nothing of the web server, the scheduler or ``dags test``.
"""

from __future__ import annotations

from deferral.runtime.process import command_group
from deferral_cli.group import DeferralGroup, Lazy

# Every subcommand of ``deferral``: where it is defined, and the line ``--help`` shows.
COMMANDS = {
    "approvals": Lazy(
        "deferral_cli.approvals:approvals",
        "Human in the loop: tasks awaiting input, and responding to them.",
    ),
    "assets": Lazy(
        "deferral_cli.assets:assets",
        "Assets: what tasks' outlets and watchers update, and what DAG schedules wait for.",
    ),
    "connections": Lazy(
        "deferral_cli.connections:connections",
        "Connections to external systems (DEFERRAL_CONN_<CONN_ID> wins over the table).",
    ),
    "dags": Lazy("deferral_cli.dags:dags", "DAGs in the DAGs folder."),
    "db": Lazy("deferral_cli.db:db", "Database schema."),
    "dead": Lazy(
        "deferral_cli.dead:dead",
        "Dead letters: entries a consumer set aside (bad data, or delivered too often).",
    ),
    "doctor": Lazy(
        "deferral_cli.inspect:doctor_command",
        "Check why deferred tasks may be stuck; exit 1 if any check fails (2 if PostgreSQL or"
        " Redis cannot be reached at all).",
    ),
    "health": Lazy(
        "deferral_cli.health:health_command",
        "Exit 0 if Postgres and Redis answer and, with --service and --name, that process's"
        " heartbeat is fresh (at most 2.1 x DEFERRAL_HEARTBEAT_SEC old); else exit 1.",
    ),
    "reshard-streams": Lazy(
        "deferral_cli.inspect:reshard_streams",
        "Change the shard count of the triggers and events streams (DEFERRAL_STREAM_SHARDS),"
        " with every scheduler, worker and triggerer stopped.",
    ),
    "rotate-fernet-key": Lazy(
        "deferral_cli.keys:rotate_fernet_key",
        "Re-encrypt stored kwargs and secrets with the first key of DEFERRAL_FERNET_KEY.",
    ),
    "runs": Lazy("deferral_cli.runs:runs", "DAG runs."),
    "signals": Lazy(
        "deferral_cli.signals:signals_group",
        "Signals: resume the tasks waiting on a key (SignalTrigger / wait_for_signal).",
    ),
    "standalone": Lazy(
        "deferral_cli.standalone:standalone",
        "Run scheduler, triggerer, worker and (without --run) the web UI together, for trying"
        " deferral out.",
    ),
    "streams": Lazy(
        "deferral_cli.inspect:streams",
        "Show each stream's length, its consumer groups, their lag and pending entries per"
        " consumer.",
    ),
    "tasks": Lazy("deferral_cli.tasks:tasks", "Task instances."),
    "tokens": Lazy(
        "deferral_cli.tokens:tokens",
        "API tokens for machines: signals, callbacks and runs through the web API.",
    ),
    "triggerers": Lazy("deferral_cli.triggers:triggerers", "Triggerer processes."),
    "triggers": Lazy(
        "deferral_cli.triggers:triggers",
        "Triggers (their kwargs stay encrypted and are never shown).",
    ),
    "users": Lazy("deferral_cli.users:users", "Web UI users (`deferral webserver`)."),
    "variables": Lazy(
        "deferral_cli.variables:variables",
        "Variables: named values for tasks and templates (DEFERRAL_VAR_<KEY> wins over the table).",
    ),
    "webserver": Lazy(
        "deferral_cli.webserver:webserver_command",
        "Serve the web UI: DAGs, their grid and graph, task instances and their logs, what is"
        " deferred now, triggerers, streams and the doctor's checklist; and a JSON API under"
        " /api/v1/.",
    ),
    "workers": Lazy("deferral_cli.triggers:workers", "Worker processes."),
    "xcom": Lazy(
        "deferral_cli.xcom:xcom",
        "XComs: values tasks pushed (their return value under the key return_value).",
    ),
}


@command_group(cls=DeferralGroup, lazy=COMMANDS)
def main() -> None:
    """deferral: a workflow runtime whose tasks can defer their waits to triggers.

    Exit status: 0 done, 1 failed (a run failed, a thing named does not exist...), 2 a usage
    error or PostgreSQL / Redis cannot be reached, 3 `dags trigger --wait` timed out.
    """


__all__ = ["main"]
