"""Airflow's ``example_sensors`` (16 tasks, sensors of every mode waiting side by side) under
``deferral dags test`` and on a running stack (issue 35).

    .venv/bin/python benchmarks/dags_test_sensors.py

On a fresh database, the unmodified Airflow 3 DAG file (``airflow_imports``) runs first under
``deferral dags test`` (no service running: it refuses to start beside a scheduler), timed from
the command's start to its exit; then a scheduler, a triggerer and a worker (16 slots, the
default) start, the DAG is triggered once they are up, and the run is timed from its creation to
its end. Both also give the run's own span (start_date to end_date, PostgreSQL's clock). The
target: ``dags test`` takes at most 1.5 times the stack's time. A calibration line says how fast
this machine was: single-row commits per second with one client, and a pure-Python loop's rate.
"""

# ruff: noqa: E501  (the Airflow file below is kept as Airflow wrote it)
from __future__ import annotations

import argparse
import subprocess
import time

from harness import Figure, Stack, calibration, report, wait_for
from sqlalchemy import text

from tests.e2e.conftest import command

DAG_ID = "example_sensors"
# airflow/providers/standard/example_dags/example_sensors.py of Apache Airflow 3 (Apache License
# 2.0), with its licence header and doc markers left out.
EXAMPLE_SENSORS = """
from __future__ import annotations

import datetime

from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.sensors.bash import BashSensor
from airflow.providers.standard.sensors.filesystem import FileSensor
from airflow.providers.standard.sensors.python import PythonSensor
from airflow.providers.standard.sensors.time import TimeSensor
from airflow.providers.standard.sensors.time_delta import TimeDeltaSensor
from airflow.providers.standard.sensors.weekday import DayOfWeekSensor
from airflow.providers.standard.utils.weekday import WeekDay
from airflow.sdk import DAG
from airflow.utils.trigger_rule import TriggerRule


def success_callable():
    return True


def failure_callable():
    return False


with DAG(
    dag_id="example_sensors",
    schedule=None,
    start_date=datetime.datetime(2021, 1, 1, tzinfo=datetime.timezone.utc),
    catchup=False,
    tags=["example"],
) as dag:
    t0 = TimeDeltaSensor(task_id="wait_some_seconds", delta=datetime.timedelta(seconds=2))
    t0a = TimeDeltaSensor(
        task_id="wait_some_seconds_async", delta=datetime.timedelta(seconds=2), deferrable=True
    )
    t1 = TimeSensor(
        task_id="fire_immediately", target_time=datetime.datetime.now(tz=datetime.timezone.utc).time()
    )
    t2 = TimeSensor(
        task_id="timeout_after_second_date_in_the_future",
        timeout=1,
        soft_fail=True,
        target_time=(datetime.datetime.now(tz=datetime.timezone.utc) + datetime.timedelta(hours=1)).time(),
    )
    t1a = TimeSensor(
        task_id="fire_immediately_async",
        target_time=datetime.datetime.now(tz=datetime.timezone.utc).time(),
        deferrable=True,
    )
    t2a = TimeSensor(
        task_id="timeout_after_second_date_in_the_future_async",
        timeout=1,
        soft_fail=True,
        target_time=(datetime.datetime.now(tz=datetime.timezone.utc) + datetime.timedelta(hours=1)).time(),
        deferrable=True,
    )
    t3 = BashSensor(task_id="Sensor_succeeds", bash_command="exit 0")
    t4 = BashSensor(task_id="Sensor_fails_after_3_seconds", timeout=3, soft_fail=True, bash_command="exit 1")
    t5 = BashOperator(task_id="remove_file", bash_command="rm -rf /tmp/temporary_file_for_testing")
    t6 = FileSensor(task_id="wait_for_file", filepath="/tmp/temporary_file_for_testing")
    t7 = FileSensor(
        task_id="wait_for_file_async", filepath="/tmp/temporary_file_for_testing", deferrable=True
    )
    t8 = BashOperator(
        task_id="create_file_after_3_seconds", bash_command="sleep 3; touch /tmp/temporary_file_for_testing"
    )
    t9 = PythonSensor(task_id="success_sensor_python", python_callable=success_callable)
    t10 = PythonSensor(
        task_id="failure_timeout_sensor_python", timeout=3, soft_fail=True, python_callable=failure_callable
    )
    t11 = DayOfWeekSensor(
        task_id="week_day_sensor_failing_on_timeout", timeout=3, soft_fail=True, week_day=WeekDay.MONDAY
    )
    tx = BashOperator(task_id="print_date_in_bash", bash_command="date")
    tx.trigger_rule = TriggerRule.NONE_FAILED
    [t0, t0a, t1, t1a, t2, t2a, t3, t4] >> tx
    t5 >> t6 >> t7 >> tx
    t8 >> tx
    [t9, t10] >> tx
    t11 >> tx
"""


def run_span(stack: Stack, run_type: str) -> float:
    """Seconds from the start to the end of the DAG's run whose id starts with ``run_type``."""
    with stack.sessions() as session:
        return float(
            session.execute(
                text(
                    "SELECT extract(epoch FROM end_date - start_date) FROM dag_run"
                    " WHERE dag_id = :dag AND run_id LIKE :prefix AND end_date IS NOT NULL"
                ),
                {"dag": DAG_ID, "prefix": f"{run_type}%"},
            ).scalar_one()
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600, help="Give up on a run after S s.")
    args = parser.parse_args()
    with Stack() as stack:
        stack.write_dag(DAG_ID, EXAMPLE_SENSORS)
        (stack.dags / ".deferral.toml").write_text("airflow_imports = true\n")
        print(calibration())

        started = time.monotonic()
        tested = subprocess.run(
            command("deferral", "dags", "test", DAG_ID),
            env=stack.env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        dags_test_sec = time.monotonic() - started
        if tested.returncode != 0:
            raise SystemExit(f"dags test failed:\n{tested.stdout[-3000:]}{tested.stderr[-3000:]}")
        dags_test_span = run_span(stack, "manual__")

        stack.start("scheduler")
        stack.start("triggerer")
        stack.start("worker", "--concurrency", "16")
        stack.wait_started("scheduler", "triggerer", "worker")
        started = time.monotonic()
        stack.trigger(DAG_ID, ["stack"])
        wait_for(
            lambda: stack.run_state(DAG_ID, "stack") in ("success", "failed"),
            timeout=args.timeout,
            interval=0.1,
            what="the run on the stack",
        )
        stack_sec = time.monotonic() - started
        state = stack.run_state(DAG_ID, "stack")
        if state != "success":
            raise SystemExit(f"the run on the stack ended {state}")
        stack_span = run_span(stack, "stack")

    report(
        "example_sensors (Airflow 3's, 16 tasks): dags test against a running stack",
        [
            Figure("dags test, command start to exit", dags_test_sec, "s"),
            Figure("dags test, the run's start to end", dags_test_span, "s"),
            Figure("stack (worker --concurrency 16), trigger to the run's end", stack_sec, "s"),
            Figure("stack, the run's start to end", stack_span, "s"),
            Figure(
                "dags test / stack (command against trigger to end)",
                dags_test_sec / stack_sec,
                "x",
                target=1.5,
            ),
        ],
    )


if __name__ == "__main__":
    main()
