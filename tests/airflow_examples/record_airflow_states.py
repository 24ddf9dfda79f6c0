"""Record the states Airflow itself gives its 3.3 example DAGs, from `airflow dags test`, into
airflow_states.json (next to this file), which the tests of the copies here and
compare_states.py read. Run on demand (not in CI: it needs Airflow installed, ~10 s a DAG),
with the Python of a virtualenv outside the repository that has Airflow, e.g.::

    python3 -m venv /tmp/airflow-venv
    /tmp/airflow-venv/bin/pip install \
        apache-airflow==3.3.2 apache-airflow-providers-standard==1.21.0
    /tmp/airflow-venv/bin/python tests/airflow_examples/record_airflow_states.py

In a fresh AIRFLOW_HOME (a temporary folder, SQLite) with load_examples on, each DAG of each
example file of apache-airflow-core's ``airflow/example_dags`` and apache-airflow-providers-
standard's ``example_dags`` (files in name order, DAGs in the order their file names them) is
run on that one database by ``airflow dags test -B BUNDLE -f FILE DAG_ID
2024-05-06T12:00:00+00:00`` (with no date, at now, for a DAG whose start_date is later), each
bounded by --timeout. Then its run's
state and each of its task instances' state is read from Airflow's database."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

LOGICAL_DATE = "2024-05-06T12:00:00+00:00"
OUT = Path(__file__).with_name("airflow_states.json")

# Files not run: they need a system no test has (the network, Kubernetes, a person) or a
# scheduler, which `dags test` is not.
EXCLUDED = {
    "example_dag_decorator.py": "calls httpbin.org (network)",
    "example_external_task_parent_deferrable.py": (
        "waits for a run of child_dag it triggers, which only a scheduler runs (not `dags test`)"
    ),
    "example_hitl_operator.py": "waits for a person's answers",
    "example_kubernetes_executor.py": "Kubernetes",
    "example_local_kubernetes_executor.py": "Kubernetes",
    "example_retry_policy.py": "calls api.example.com (network)",
    "tutorial_objectstorage.py": "reads a web API into object storage (network)",
}

# DAGs whose states are not the same from one run to the next, in Airflow as anywhere: what
# varies, so that a comparison names it instead of calling it a mismatch.
VARIES = {
    "example_branch_operator": "its three branches are random.choice's",
    "example_branch_python_operator_decorator": "its three branches are random.choice's",
    "example_branch_datetime_operator_2": "branches on the time of day the run's task runs",
    "example_weekday_branch_operator": "branches on the day of the week the run's task runs",
}


def _example_bundles() -> dict[str, Path]:
    """The DAG bundles Airflow makes of its example folders (with load_examples on)."""
    # Imported here: the Airflow virtualenv has them, the repository's has not.
    import airflow
    import airflow.providers.standard

    return {
        "example_dags": Path(airflow.__file__).parent / "example_dags",
        "apache-airflow-providers-standard-example-dags": (
            Path(airflow.providers.standard.__file__).parent / "example_dags"
        ),
    }


def _dags_of(path: Path) -> list[tuple[str, dt.datetime | None]]:
    """The DAG ids of a file, each with its start date, as Airflow parses it, in the order the
    file names them (Airflow's bag sorts them; a DAG waiting on another's run, as
    example_external_task_marker_child does, comes after it in its file)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(path), bundle_path=path.parent)
    if bag.import_errors:
        raise SystemExit(f"{path.name}: Airflow could not import it: {bag.import_errors}")
    source = path.read_text()

    def named_at(dag_id: str) -> int:
        # Where its dag_id= is (another DAG of the file may name it before, as the parent's
        # ExternalTaskMarker names the child), else the first word that is its id (an @asset's
        # function name).
        for pattern in (rf"dag_id=[\"']{re.escape(dag_id)}[\"']", rf"\b{re.escape(dag_id)}\b"):
            if found := re.search(pattern, source):
                return found.start()
        return len(source)

    return [(dag_id, bag.dags[dag_id].start_date) for dag_id in sorted(bag.dags, key=named_at)]


def _run(
    env: dict[str, str],
    bundle: str,
    path: Path,
    dag_id: str,
    date: str | None,
    timeout: float,
    log: Path,
) -> int | None:
    """`airflow dags test`'s exit status, or None if it was still running after ``timeout``
    (then it and its task processes are killed)."""
    airflow = str(Path(sys.executable).parent / "airflow")
    argv = [airflow, "dags", "test", "-B", bundle, "-f", str(path), dag_id]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, *([date] if date else [])],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def _states(db: Path, dag_id: str) -> tuple[str | None, dict[str, str | None]]:
    """The state of the DAG's last run and of each of that run's task instances (a mapped
    one's as ``task_id[map_index]``)."""
    with sqlite3.connect(db) as conn:
        row = conn.execute(
            "SELECT run_id, state FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1",
            (dag_id,),
        ).fetchone()
        if row is None:
            return None, {}
        run_id, state = row
        tis = conn.execute(
            "SELECT task_id, map_index, state FROM task_instance"
            " WHERE dag_id = ? AND run_id = ? ORDER BY task_id, map_index",
            (dag_id, run_id),
        ).fetchall()
    return state, {
        task_id if map_index < 0 else f"{task_id}[{map_index}]": ti_state
        for task_id, map_index, ti_state in tis
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per DAG")
    parser.add_argument("--only", nargs="*", help="these DAG ids only (the others not run)")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="airflow-home-"))
    (home / "dags").mkdir()
    # Airflow's own example bundles, and their plugins (example_custom_weight's priority
    # strategy, example_workday_timetable's timetable): what load_examples turns on.
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "True"}
    os.environ.update(env)  # this process's DagBag reads the same configuration
    subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "db", "migrate"],
        env=env,
        check=True,
        capture_output=True,
    )
    logical = dt.datetime.fromisoformat(LOGICAL_DATE)
    results: dict[str, Any] = {}
    files = sorted(
        (path.name, bundle, path)
        for bundle, folder in _example_bundles().items()
        for path in folder.glob("*.py")
        if path.name != "__init__.py" and path.name not in EXCLUDED
    )
    for _, bundle, path in files:
        for dag_id, start in _dags_of(path):
            if args.only and dag_id not in args.only:
                continue
            date = None if start is not None and start > logical else LOGICAL_DATE
            log = home / f"{dag_id}.log"
            code = _run(env, bundle, path, dag_id, date, args.timeout, log)
            state, tasks = _states(home / "airflow.db", dag_id)
            results[dag_id] = {
                "file": path.name,
                "logical_date": date or "now",
                "state": state if code is not None else f"timeout after {args.timeout:.0f} s",
                "tasks": tasks,
                **({"varies": VARIES[dag_id]} if dag_id in VARIES else {}),
            }
            print(f"{dag_id}: {results[dag_id]['state']} (log {log})", flush=True)
            _write(args.out, results, partial=bool(args.only))


def _write(out: Path, results: dict[str, Any], partial: bool) -> None:
    """The record so far (after each DAG: a run stopped keeps what it did); a partial run
    (--only) updates the DAGs it ran in the record there, keeping the others."""
    record = {
        "recorded": dt.date.today().isoformat(),
        "versions": {
            name: importlib.metadata.version(name)
            for name in (
                "apache-airflow",
                "apache-airflow-core",
                "apache-airflow-providers-standard",
            )
        },
        "command": f"airflow dags test -B BUNDLE -f FILE DAG_ID {LOGICAL_DATE} (no date: at now)",
        "excluded": EXCLUDED,
        "dags": results,
    }
    if partial and out.exists():
        record["dags"] = {**json.loads(out.read_text())["dags"], **results}
    out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
