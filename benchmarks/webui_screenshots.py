"""Screenshots of the web UI, for a reader who does not run it: the DAG page of
``example_deferrable`` (grid and graph) while its task is deferred, the Deferred now page, and
the task instance page with its log.

Runs scheduler, triggerer, worker and the web UI against a throw-away database and stream prefix
(see scratch.py) with the DAGs of ``examples/``, and drives Debian's headless Chromium:

    .venv/bin/python benchmarks/webui_screenshots.py [--out webui-screenshots]

The PNGs differ on every run (times, ids), so they are not committed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

from scratch import scratch_deployment
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from sqlalchemy import select

from deferral.loading.dagbag import DagBag
from deferral.store import actions
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import TaskInstance
from deferral_cli import health_checks
from deferral_cli.embedded import free_port, running_services, wait_for_webserver
from webserver import users

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DAG_ID = "example_deferrable"


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"gave up waiting for {what}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("webui-screenshots"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    port = free_port()
    password = secrets.token_urlsafe(12)
    os.environ.update(DEFERRAL_WEBSERVER_PORT=str(port), **{users.ADMIN_PASSWORD_ENV: password})
    with (
        scratch_deployment(EXAMPLES, "screenshots") as url,
        running_services(webserver=True) as procs,
    ):
        if not wait_for_webserver(health_checks.webserver_url("127.0.0.1", port), procs[-1]):
            sys.exit("the web UI did not start")
        sessions = make_sessionmaker(make_engine(url))
        dag = DagBag(EXAMPLES).collect().get_dag(DAG_ID)

        def states(run_id: str) -> dict[str, str]:
            with sessions() as session:
                rows = session.execute(
                    select(TaskInstance.task_id, TaskInstance.state).where(
                        TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id
                    )
                )
                return {task_id: state for task_id, state in rows}

        # A finished run first, so that the grid has history, then one that waits.
        done = actions.trigger_run(sessions, dag, {"wait_seconds": 1}, "first").run_id
        _until(lambda: states(done).get("report") == "success", 120, "the first run")
        waiting = actions.trigger_run(sessions, dag, {"wait_seconds": 40}, "waiting").run_id
        _until(lambda: states(waiting).get("wait") == "deferred", 120, "the task to defer")

        options = webdriver.ChromeOptions()
        options.binary_location = args.chromium
        for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
            options.add_argument(argument)
        options.add_argument("--window-size=1300,900")
        os.environ["SE_OFFLINE"] = "true"
        driver = webdriver.Chrome(service=Service(args.chromedriver), options=options)
        base = f"http://127.0.0.1:{port}"
        try:
            shots = {
                "dag-grid-while-deferred.png": f"/dags/{DAG_ID}",
                "deferred-now.png": "/deferred",
                "task-instance-log.png": f"/dags/{DAG_ID}/task_instance?"
                + urlencode({"run_id": done, "task_id": "wait"}),
                "dags.png": "/dags",
            }
            for name, path in shots.items():
                driver.get(base + path)
                driver.find_element(By.TAG_NAME, "main")
                time.sleep(0.5)  # fonts and layout settle
                if name == "task-instance-log.png":
                    log = driver.find_element(By.ID, "log-panel")
                    driver.execute_script("arguments[0].scrollIntoView()", log)
                driver.save_screenshot(str(args.out / name))
                print(f"wrote {args.out / name}")
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
