"""The web UI in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven
by Selenium; nothing is downloaded), against real scheduler, triggerer, worker and webserver
processes: the grid shows the example DAG's task deferred while it waits and succeeded after,
clicking a task shows its log, clearing from the page runs it again, a wrong password is
refused, and ids holding markup stay text. One set of processes and one browser serve the
module; the tests run in file order and build on each other's run."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy import insert
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.runtime.crypto import Cipher
from deferral.states import TaskState
from deferral.store import transitions
from deferral.store.tables import SerializedDag, TaskInstance
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Stack, command, fire_deferred
from tests.helpers import wait_for
from webserver import users

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "example_deferrable.py"
DAG_ID = "example_deferrable"
ADMIN_PASSWORD = "browser-admin-pass"
# Longer than any test: the test fires the trigger itself once it has seen the wait
# (fire_deferred), so a loaded machine cannot end the wait before the page is looked at.
WAIT_SECONDS = 3600


class UI:
    """The browser, the server's address, and the database behind it."""

    def __init__(
        self, driver: WebDriver, base: str, sessions: sessionmaker[Session], broker: Broker
    ) -> None:
        self.driver, self.base, self.sessions, self.broker = driver, base, sessions, broker

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def find(self, css: str) -> Any:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def found(self, css: str) -> list[Any]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def cell(self, task_id: str) -> dict[str, str] | None:
        """The grid cell of ``task_id`` in the newest run (the rightmost column): its state and
        classes, read in one go (the live refresh may replace the element at any moment)."""
        found: dict[str, str] | None = self.driver.execute_script(
            """const cells = document.querySelectorAll(`a.cell[data-task="${arguments[0]}"]`);
            if (!cells.length) return null;
            const cell = cells[cells.length - 1];
            return {state: cell.dataset.state, classes: cell.className,
                    colour: getComputedStyle(cell).backgroundColor};""",
            task_id,
        )
        return found

    def state_of(self, task_id: str) -> str | None:
        cell = self.cell(task_id)
        return cell["state"] if cell is not None else None

    def click(self, css: str, text: str | None = None) -> None:
        """Click the last element ``css`` finds (of those showing ``text``, if given), again if
        the live refresh replaced it."""

        def clicked() -> bool:
            try:
                found = [e for e in self.found(css) if text is None or e.text == text]
                found[-1].click()
            except (StaleElementReferenceException, IndexError):
                return False
            return True

        wait_for(clicked, timeout=15, what=f"to click {css}")


@pytest.fixture(scope="module")
def ui(module_stack: Stack) -> Iterator[UI]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: apt-get install -y chromium chromium-driver")
    shutil.copy(EXAMPLE, module_stack.dags_folder / EXAMPLE.name)
    services = module_stack.services
    services.env[users.ADMIN_PASSWORD_ENV] = ADMIN_PASSWORD
    port = free_port()
    for name in ("scheduler", "triggerer", "worker"):
        services.start(name)
    services.spawn("webserver", command("deferral", "webserver", "--port", str(port)), services.env)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,1000")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch anything
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(0)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: _answers(base + "/api/v1/health"), timeout=180, what="the webserver to answer"
        )
        wait_for(
            lambda: _parsed(module_stack, DAG_ID),
            timeout=180,
            what="the scheduler to parse the DAG the pages show",
        )
        yield UI(driver, base, module_stack.sessions, module_stack.broker)
    finally:
        driver.quit()  # the processes stop with module_stack


def _parsed(stack: Stack, dag_id: str) -> bool:
    with stack.sessions() as session:
        return session.get(SerializedDag, dag_id) is not None


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _log_in(ui: UI, password: str) -> None:
    ui.open("/login")
    ui.find("#username").send_keys("admin")
    ui.find("#password").send_keys(password)
    ui.find("#login-form button[type=submit]").click()


def test_a_wrong_password_is_refused(ui: UI) -> None:
    _log_in(ui, "not-the-password")
    assert wait_for(lambda: ui.found("#login-refused"), timeout=15)
    assert ui.find("#login-refused").text == "Wrong user name or password."
    ui.open(f"/dags/{DAG_ID}")
    assert ui.found("#login-link")  # still nobody

    _log_in(ui, ADMIN_PASSWORD)
    wait_for(lambda: "/dags" in ui.driver.current_url and not ui.found("#login-link"), timeout=15)


def test_the_grid_shows_the_task_deferred_while_it_waits_then_succeeded(
    ui: UI, cipher: Cipher
) -> None:
    ui.open(f"/dags/{DAG_ID}")
    # A field per param, its default filled in (Airflow's trigger form).
    field = ui.find('#param-fields [name="param:wait_seconds"]')
    assert field.get_attribute("value") == "3" and field.get_attribute("type") == "number"
    field.clear()
    field.send_keys(str(WAIT_SECONDS))
    ui.find("#trigger-button").click()
    wait_for(lambda: ui.found(".flash.ok"), timeout=15, what="the trigger to be confirmed")

    # The page is not reloaded: its live part refreshes itself.
    wait_for(
        lambda: ui.state_of("wait") == "deferred", timeout=60, what="the grid to show wait deferred"
    )
    cell = ui.cell("wait")
    assert cell is not None and "s-deferred" in cell["classes"].split()
    assert cell["colour"] == "rgb(143, 107, 216)"  # purple, striped: waiting, not working
    graph_state = ui.driver.execute_script(
        "return document.querySelector('svg.graph a[data-task=\"wait\"]').dataset.state"
    )
    assert graph_state == "deferred"
    # Deferred now: the task under its trigger's class and the triggerer running it.
    ui.open("/deferred")
    group = ui.find(".deferred-group")
    assert "deferral.triggers.temporal.TimeDeltaTrigger" in group.text
    assert ui.find('.deferred-task[data-task="wait"]')
    ui.driver.back()
    fire_deferred(ui.sessions, ui.broker, cipher, DAG_ID, "wait")  # the wait ends now

    wait_for(
        lambda: ui.state_of("report") == "success" and ui.state_of("wait") == "success",
        timeout=90,
        what="the grid to show both tasks succeeded",
    )
    # The scheduler marks the run once it sees its last task finished: a loop later, so the
    # run's row may show it one refresh after the tasks' cells.
    wait_for(
        lambda: ui.found('.run-state[data-state="success"]'),
        timeout=30,
        what="the grid to show the run succeeded",
    )


def test_clicking_a_task_shows_its_log(ui: UI) -> None:
    ui.open(f"/dags/{DAG_ID}")
    ui.click('a.cell[data-task="wait"]')
    wait_for(lambda: ui.found("#log-lines"), timeout=15, what="the task instance page")
    assert ui.find("#ti-task").text == "wait"
    log = ui.find("#log-lines").text
    assert "trigger fired at" in log, log  # what the resumed task printed
    assert "deferred" in log  # the worker's or triggerer's lines about the deferral


def test_clear_from_the_page_runs_the_task_again(ui: UI) -> None:
    ui.open(f"/dags/{DAG_ID}")
    ui.click('a.cell[data-task="report"]')
    wait_for(lambda: ui.found("#clear-button"), timeout=15)
    assert ui.find("#ti-try").get_attribute("data-try") == "1"
    ui.click("#clear-button")
    alert = wait_for(lambda: _alert(ui), timeout=10, what="the confirmation")
    assert "runs again as a new try" in alert.text
    alert.accept()
    wait_for(
        lambda: ui.driver.execute_script(
            "const t = document.getElementById('ti-try'), s = document.getElementById('ti-state');"
            "return t && s && t.dataset.try === '2' && s.dataset.state === 'success';"
        ),
        timeout=90,
        what="report to run again and succeed as try 2",
    )
    assert "report: none" in ui.find(".flash.ok").text
    # The log follows: a tab per try, the new one shown.
    wait_for(
        lambda: [tab.text for tab in ui.found(".try-tab")] == ["try 1", "try 2"],
        timeout=30,
        what="the log to offer both tries",
    )
    assert ui.find(".try-tab.current").text == "try 2"


def _alert(ui: UI) -> Any:
    try:
        return ui.driver.switch_to.alert
    except NoAlertPresentException:
        return None


def test_markup_in_a_task_id_or_run_id_is_inert(ui: UI) -> None:
    script_run, script_task = (
        "<script>window.__xss=1</script>",
        '<img src=x onerror="window.__xss=2">',
    )
    with ui.sessions.begin() as session:
        transitions.create_dag_run(session, DAG_ID, script_run, dt.datetime.now(dt.UTC), {})
        session.execute(
            insert(TaskInstance).values(
                dag_id=DAG_ID, run_id=script_run, task_id=script_task, state=TaskState.DEFERRED
            )
        )
    for path in ("/dags", f"/dags/{DAG_ID}", "/deferred"):
        ui.open(path)
        assert script_run in ui.driver.find_element(By.TAG_NAME, "body").text or path == "/dags"
        assert ui.driver.execute_script("return window.__xss") is None, path
        assert _alert(ui) is None
    ui.open("/deferred")
    assert script_task in [row.text for row in ui.found(".deferred-task a.ti-link")]
    ui.click(".deferred-task a.ti-link", script_task)
    wait_for(lambda: ui.found("#ti-task"), timeout=15)
    assert ui.find("#ti-task").text == script_task
    assert ui.find("#ti-run").text == script_run
    assert ui.driver.execute_script("return window.__xss") is None


SLOW_FETCH = """
window.__calls = 0; window.__inflight = 0; window.__most = 0; window.__done = 0;
const realFetch = window.fetch.bind(window);
window.fetch = async function (...args) {
  window.__calls++; window.__inflight++;
  window.__most = Math.max(window.__most, window.__inflight);
  await new Promise((resolve) => setTimeout(resolve, 3000));  // a server taking 3 s
  try { return await realFetch(...args); } finally { window.__inflight--; window.__done++; }
};
"""


def test_the_live_refresh_waits_for_each_answer_and_backs_off(ui: UI) -> None:
    ui.open(f"/dags/{DAG_ID}")
    ui.driver.execute_script(SLOW_FETCH)
    wait_for(
        lambda: ui.driver.execute_script("return window.__done") >= 1,
        timeout=30,
        what="the first refresh to be answered",
    )
    calls, most = ui.driver.execute_script("return [window.__calls, window.__most]")
    # A timer every 2 s would have sent a second request while the first was unanswered.
    assert (calls, most) == (1, 1)


GRAPH_DAGS = """
from deferral import DAG
from deferral.operators import EmptyOperator
from deferral.utils.task_group import TaskGroup

with DAG("graph_skips_layers", schedule=None):
    summarize = EmptyOperator(task_id="summarize")
    with TaskGroup("branches"):
        choose = EmptyOperator(task_id="choose")
        big_day, small_day = EmptyOperator(task_id="big_day"), EmptyOperator(task_id="small_day")
        choose >> [big_day, small_day]
    join = EmptyOperator(task_id="join")
    summarize >> choose
    [big_day, small_day] >> join
    summarize >> join  # skips every layer between

with DAG("graph_sixty_wide", schedule=None):
    start, end = EmptyOperator(task_id="start"), EmptyOperator(task_id="end")
    for n in range(60):
        start >> EmptyOperator(task_id=f"wide_{n:02d}") >> end
"""

_GEOMETRY = """
const svg = document.getElementById("graph");
const boxes = [...svg.querySelectorAll("a")].map(a => {
  const r = a.querySelector("rect");
  return {name: a.dataset.task || a.dataset.group, x: +r.getAttribute("x"),
          y: +r.getAttribute("y"), w: +r.getAttribute("width"), h: +r.getAttribute("height")};
});
const edges = [...svg.querySelectorAll("polyline.edge")].map(p => ({
  source: p.dataset.source, target: p.dataset.target,
  points: p.getAttribute("points").trim().split(/\\s+/).map(xy => xy.split(",").map(Number)),
}));
return {boxes, edges};
"""


def _passes_through(points: list[list[float]], box: dict[str, Any]) -> bool:
    """Whether the polyline enters the inside of the box (sampled along each segment)."""
    for (x1, y1), (x2, y2) in itertools.pairwise(points):
        for i in range(201):
            x, y = x1 + (x2 - x1) * i / 200, y1 + (y2 - y1) * i / 200
            if box["x"] < x < box["x"] + box["w"] and box["y"] < y < box["y"] + box["h"]:
                return True
    return False


def test_graph_edges_go_around_boxes_and_groups_collapse(ui: UI, module_stack: Stack) -> None:
    (module_stack.dags_folder / "graph_dags.py").write_text(GRAPH_DAGS)

    def geometry() -> dict[str, Any] | None:
        ui.open("/dags/graph_skips_layers")
        if not ui.found("#graph"):
            return None
        found: dict[str, Any] = ui.driver.execute_script(_GEOMETRY)
        return found

    drawn = wait_for(geometry, timeout=60, what="the graph of graph_skips_layers")
    # The drawn edges are the DAG's edges, each once.
    assert sorted((e["source"], e["target"]) for e in drawn["edges"]) == [
        ("branches.big_day", "join"),
        ("branches.choose", "branches.big_day"),
        ("branches.choose", "branches.small_day"),
        ("branches.small_day", "join"),
        ("summarize", "branches.choose"),
        ("summarize", "join"),
    ]
    through = [
        (edge["source"], edge["target"], box["name"])
        for edge in drawn["edges"]
        for box in drawn["boxes"]
        if box["name"] not in (edge["source"], edge["target"])
        and _passes_through(edge["points"], box)
    ]
    assert through == []

    # Collapsing the group: one box stands for its three tasks, with their edges.
    ui.click('#graph-groups a[data-group="branches"]')
    wait_for(lambda: ui.found('svg.graph a[data-group="branches"]'), what="the collapsed group")
    collapsed = ui.driver.execute_script(_GEOMETRY)
    assert sorted((e["source"], e["target"]) for e in collapsed["edges"]) == [
        ("branches", "join"),
        ("summarize", "branches"),
        ("summarize", "join"),
    ]
    assert "collapse=branches" in ui.driver.current_url


def test_a_sixty_task_wide_graph_scrolls_and_fits_the_page_whole(ui: UI) -> None:
    wait_for(
        lambda: ui.open("/dags/graph_sixty_wide") or ui.found("#graph"),
        timeout=60,
        what="the graph of graph_sixty_wide",
    )
    size = "const r = document.getElementById('graph').getBoundingClientRect();"
    frame = "const f = document.getElementById('graph-frame').getBoundingClientRect();"
    natural = ui.driver.execute_script(size + frame + "return [r.height, f.height];")
    assert natural[0] > natural[1]  # taller than its frame: the frame scrolls
    ui.click("#graph-fit")
    fitted = ui.driver.execute_script(
        size + frame + "return [r.left, r.top, r.right, r.bottom, f.left, f.top, f.right, f.bottom,"
        " window.innerWidth, window.innerHeight];"
    )
    left, top, right, bottom, f_left, f_top, f_right, f_bottom, width, height = fitted
    # Every box of the graph inside the frame, and the frame inside the window.
    assert f_left <= left and right <= f_right + 1 and f_top <= top and bottom <= f_bottom + 1
    assert f_left >= 0 and f_right <= width and f_bottom - f_top <= height
    assert ui.find("#graph-fit").text == "Actual size"
