"""Run every example DAG of airflow_states.json with `deferral dags test` under the import hook
and compare its run's state and task states with those `airflow dags test` gave
(record_airflow_states.py). Run on demand (not in CI: about ten seconds a DAG), from the
repository's root, naming Airflow's two example folders as the packages ship them (the files
are copied into a temporary DAGs folder with this folder's .deferral.toml)::

    SP=/tmp/airflow-venv/lib/python3.11/site-packages/airflow
    .venv/bin/python -m tests.airflow_examples.compare_states \\
        $SP/example_dags $SP/providers/standard/example_dags

The DAGs run as Airflow's did: one after the other on one fresh database (a copy of the tests'
migrated template on the tests' PostgreSQL, dropped afterwards; a stream prefix of its own on
their Redis), each at 2024-05-06T12:00:00+00:00, or at now where Airflow's was. Each DAG is
reported as "match", "varies" (the run's state and its tasks are Airflow's, which of them
skipped is the run's random choice or its time: the record's ``varies``), "differs" (a
difference this file names in DIFFERS, with its reason) or "MISMATCH"; the exit status is 1 if
any is a mismatch."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet
from sqlalchemy import select

from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import DagRun, TaskInstance
from tests.conftest import delete_stream_keys, fresh_database, new_stream_prefix
from tests.servers import REDIS_URL

HERE = Path(__file__).parent
RECORD = HERE / "airflow_states.json"
DEFERRAL = Path(sys.executable).parent / "deferral"

# Files deferral does not run, though Airflow does (their reason in the README's table): none
# since every example that needs no external system runs.
NOT_RUN: dict[str, str] = {}

# dag_id -> why deferral's states are not Airflow's, where that is deliberate.
DIFFERS = {
    "example_sensors": (
        "Airflow's TimeSensor defers with no timeout, so the trigger of"
        " timeout_after_second_date_in_the_future_async waits for its target an hour ahead (its"
        " timeout=1 is not the deferral's): `dags test` had not ended after 900 s; deferral's"
        " sensors defer for at most their timeout (deferral/sensors/base.py), so soft_fail skips"
        " it at once and the run succeeds; each task Airflow had ended ends the same here"
    ),
    "example_task_state_store_async": (
        "Airflow 3.3.2's TaskStateStoreAccessor has no aget (AttributeError at each try: the"
        " example is ahead of its release); deferral's has, and the run succeeds"
    ),
}


def _copy_examples(folders: list[Path], dags: Path) -> None:
    """The folders' files and subfolders (their sql/ templates) into ``dags``, with the import
    hook turned on; the packages' ``__init__.py`` stay out (the folder is no package)."""
    for folder in folders:
        shutil.copytree(
            folder, dags, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    (dags / "__init__.py").unlink(missing_ok=True)
    shutil.copy(HERE / ".deferral.toml", dags / ".deferral.toml")


def _states(url: str, dag_id: str) -> tuple[str | None, dict[str, str | None]]:
    """The state of the DAG's last run and of its task instances, named as in the record."""
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as session:
            run = session.scalars(
                select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc()).limit(1)
            ).first()
            if run is None:
                return None, {}
            tis = session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id
                )
            ).all()
            return run.state, {
                ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": ti.state
                for ti in tis
            }
    finally:
        engine.dispose()


def _verdict(dag_id: str, want: dict[str, Any], got: tuple[str | None, dict[str, Any]]) -> str:
    if (want["state"], want["tasks"]) == got:
        return "match"
    state, tasks = got
    if "varies" in want and (state, set(tasks)) == (want["state"], set(want["tasks"])):
        return f"varies: {want['varies']}"
    if dag_id in DIFFERS:
        return f"differs: {DIFFERS[dag_id]}"
    wrong = {
        task: f"{tasks.get(task)} (Airflow: {want['tasks'].get(task)})"
        for task in sorted(set(tasks) | set(want["tasks"]))
        if tasks.get(task) != want["tasks"].get(task)
    }
    return f"MISMATCH: run {state} (Airflow: {want['state']}); {wrong}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="Airflow's example_dags folders")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per DAG")
    parser.add_argument("--only", nargs="*", help="these DAG ids only")
    parser.add_argument("--record", type=Path, default=RECORD, help="Airflow's states")
    args = parser.parse_args()
    record = json.loads(args.record.read_text())
    work = Path(tempfile.mkdtemp(prefix="deferral-examples-"))
    dags = work / "dags"
    _copy_examples(args.folders, dags)
    database = fresh_database("deferral_examples")
    url = next(database)
    prefix = new_stream_prefix()
    env = {
        **os.environ,
        "DEFERRAL_DATABASE_URL": url,
        "DEFERRAL_REDIS_URL": REDIS_URL,
        "DEFERRAL_STREAM_PREFIX": prefix,
        "DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(),
        "DEFERRAL_DAGS_FOLDER": str(dags),
    }
    env.pop("DEFERRAL_AIRFLOW_IMPORTS", None)  # the folder's .deferral.toml decides
    counts: dict[str, int] = {}
    try:
        for dag_id, want in record["dags"].items():
            if (args.only and dag_id not in args.only) or want["file"] in NOT_RUN:
                continue
            date = [] if want["logical_date"] == "now" else [want["logical_date"]]
            argv = [str(DEFERRAL), "dags", "test", dag_id, *date, "-S", str(dags / want["file"])]
            log = work / f"{dag_id}.log"
            with log.open("w") as out:
                try:
                    subprocess.run(
                        argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout
                    )
                except subprocess.TimeoutExpired:
                    print(f"{dag_id}: timed out (log {log})", flush=True)
            verdict = _verdict(dag_id, want, _states(url, dag_id))
            kind = verdict.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
            print(f"{dag_id}: {verdict}" + ("" if kind == "match" else f" (log {log})"), flush=True)
    finally:
        database.close()
        delete_stream_keys(REDIS_URL, prefix)
    not_run = sum(1 for want in record["dags"].values() if want["file"] in NOT_RUN)
    print(f"{counts}; not run by deferral: {not_run}; excluded: {len(record['excluded'])} files")
    sys.exit(1 if counts.get("MISMATCH") else 0)


if __name__ == "__main__":
    main()
