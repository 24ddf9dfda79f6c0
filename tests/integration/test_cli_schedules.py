"""`deferral dags pause|unpause|backfill|next-run|list|trigger` and `deferral runs list` against
the test database; bad input gets one clear line."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.loading.dagbag import DagBag
from deferral.runtime.config import Settings
from deferral.store.tables import Dag, DagRun
from deferral_cli import main as deferral_main
from scheduler import dagruns
from tests.parsed_dags import record_dags_folder

WriteDag = Callable[[str, str], Path]
UTC = dt.UTC

SOURCE = """
import datetime
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG({dag_id!r}, schedule={schedule!r}, start_date=datetime.datetime(2024, 1, 1){extra}) as dag:
    EmptyOperator(task_id="a")
"""


def day(n: int, month: int = 1) -> dt.datetime:
    return dt.datetime(2024, month, n, tzinfo=UTC)


@pytest.fixture
def make_dag(settings: Settings, write_dag: WriteDag) -> Callable[..., str]:
    def make(schedule: object = "@daily", extra: str = "") -> str:
        dag_id = f"cli_{uuid.uuid4().hex[:8]}"
        write_dag(dag_id, SOURCE.format(dag_id=dag_id, schedule=schedule, extra=extra))
        record_dags_folder(settings)  # the commands read what a scheduler parsed
        return dag_id

    return make


def run(*args: str) -> Result:
    return CliRunner().invoke(deferral_main, list(args))


def runs_of(sessions: sessionmaker[Session], dag_id: str) -> list[DagRun]:
    with sessions() as session:
        query = select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.logical_date)
        return list(session.scalars(query))


@pytest.mark.parametrize("command", ["pause", "unpause", "backfill", "next-run"])
def test_schedule_commands_have_help(command: str) -> None:
    result = run("dags", command, "--help")
    assert result.exit_code == 0 and "Usage:" in result.output


def test_runs_list_has_help() -> None:
    assert "Usage:" in run("runs", "list", "--help").output


# -- pause / unpause ---------------------------------------------------------------------------


def test_pause_and_unpause_set_the_dag_row_and_the_scheduler_keeps_it(
    settings: Settings, sessions: sessionmaker[Session], make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag()
    result = run("dags", "pause", dag_id)
    assert result.exit_code == 0 and f"DAG {dag_id} paused" in result.output
    with sessions.begin() as session:
        dagruns.sync_dags(session, DagBag(settings.dags_folder).collect(), dt.datetime.now(UTC))
    with sessions() as session:
        row = session.get(Dag, dag_id)
        assert row is not None and row.is_paused and row.schedule == "@daily"
    assert run("dags", "unpause", dag_id).exit_code == 0
    with sessions() as session:
        row = session.get(Dag, dag_id)
        assert row is not None and not row.is_paused


def test_pause_of_an_unknown_dag_names_it(settings: Settings) -> None:
    result = run("dags", "pause", "no_such_dag")
    assert result.exit_code == 1
    assert "error: DAG 'no_such_dag' not found" in result.output


# -- backfill --------------------------------------------------------------------------------


def test_backfill_creates_a_run_per_interval_and_skips_existing_ones(
    settings: Settings, sessions: sessionmaker[Session], make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag()
    result = run("dags", "backfill", dag_id, "-s", "2024-01-02", "-e", "2024-01-04")
    assert result.exit_code == 0, result.output
    assert "3 backfill run(s) created, 0 skipped" in result.output
    runs = runs_of(sessions, dag_id)
    assert [(r.run_id, r.run_type, r.state) for r in runs] == [
        (f"backfill__{day(n).isoformat()}", "backfill", "queued") for n in (2, 3, 4)
    ]
    assert [(r.data_interval_start, r.data_interval_end) for r in runs] == [
        (day(n), day(n + 1)) for n in (2, 3, 4)
    ]

    again = run(
        "dags", "backfill", dag_id, "--start-date", "2024-01-01", "--end-date", "2024-01-05"
    )
    assert again.exit_code == 0, again.output
    assert "2 backfill run(s) created, 3 skipped" in again.output
    assert f"skipped {day(3).isoformat()}: a run has this logical date already" in again.output
    assert len(runs_of(sessions, dag_id)) == 5


def test_backfill_dry_run_lists_without_creating(
    settings: Settings, sessions: sessionmaker[Session], make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag(schedule="0 */12 * * *")
    result = run(
        "dags", "backfill", dag_id, "-s", "2024-01-01", "-e", "2024-01-01T12:00", "--dry-run"
    )
    assert result.exit_code == 0, result.output
    assert f"would create backfill__{day(1).isoformat()}" in result.output
    assert "2 backfill run(s) would be created, 0 skipped" in result.output
    assert runs_of(sessions, dag_id) == []


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["-s", "2024-13-01", "-e", "2024-01-02"], 2, "'2024-13-01' is not a date"),
        (
            ["-s", "2024-01-05", "-e", "2024-01-01"],
            1,
            "error: --end-date 2024-01-01T00:00:00+00:00",
        ),
        (["-e", "2024-01-02"], 2, "Missing option '-s' / '--start-date'"),
    ],
)
def test_backfill_refuses_bad_dates_naming_the_option(
    settings: Settings,
    sessions: sessionmaker[Session],
    make_dag: Callable[..., str],
    args: list[str],
    code: int,
    message: str,
) -> None:
    dag_id = make_dag()
    result = run("dags", "backfill", dag_id, *args)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert runs_of(sessions, dag_id) == []


def test_backfill_of_an_unknown_or_unscheduled_dag_says_so(
    settings: Settings, make_dag: Callable[..., str]
) -> None:
    unknown = run("dags", "backfill", "nope", "-s", "2024-01-01", "-e", "2024-01-02")
    assert unknown.exit_code == 1 and "error: DAG 'nope' not found" in unknown.output
    manual_only = make_dag(schedule=None)
    result = run("dags", "backfill", manual_only, "-s", "2024-01-01", "-e", "2024-01-02")
    assert result.exit_code == 1
    assert f"error: DAG '{manual_only}' has schedule=None: there is nothing to backfill" in (
        result.output
    )


# -- next-run ------------------------------------------------------------------------------------


def test_next_run_follows_the_latest_automated_run(
    settings: Settings, make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag(extra=", catchup=True")
    first = run("dags", "next-run", dag_id)
    assert first.exit_code == 0, first.output
    assert f"logical date: {day(1).isoformat()}" in first.output
    assert f"data interval: {day(1).isoformat()} to {day(2).isoformat()}" in first.output
    assert f"created after: {day(2).isoformat()}" in first.output

    run("dags", "backfill", dag_id, "-s", "2024-01-01", "-e", "2024-01-09")
    assert f"logical date: {day(10).isoformat()}" in run("dags", "next-run", dag_id).output

    run("dags", "pause", dag_id)
    assert "(paused: no run is created until" in run("dags", "next-run", dag_id).output


def test_next_run_of_an_unscheduled_dag(settings: Settings, make_dag: Callable[..., str]) -> None:
    result = run("dags", "next-run", make_dag(schedule=None))
    assert result.exit_code == 0, result.output
    assert "no next run: schedule=None" in result.output


# -- list, trigger, runs list --------------------------------------------------------------------


def test_dags_list_shows_schedule_and_paused(
    settings: Settings, make_dag: Callable[..., str]
) -> None:
    daily = make_dag()
    manual = make_dag(schedule=None, extra=", is_paused_upon_creation=True")
    record_dags_folder(settings)
    run("dags", "unpause", manual)
    result = run("dags", "list")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line.split() for line in result.output.splitlines()[1:]}
    assert lines[daily][1:4] == ["@daily", "False", "1"]
    assert lines[manual][1:4] == ["None", "False", "1"]
    assert result.output.splitlines()[0].split() == [
        "DAG_ID",
        "SCHEDULE",
        "IS_PAUSED",
        "TASKS",
        "FILELOC",
        "TAGS",
    ]


def test_manual_runs_get_the_interval_the_schedule_gives_them(
    settings: Settings, sessions: sessionmaker[Session], make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag(schedule="@hourly")
    result = run("dags", "trigger", dag_id)
    assert result.exit_code == 0, result.output
    (manual,) = runs_of(sessions, dag_id)
    assert manual.run_type == "manual" and manual.run_id.startswith("manual__")
    assert manual.data_interval_end is not None and manual.data_interval_start is not None
    # The last complete hour before the trigger.
    assert manual.data_interval_end == manual.logical_date.replace(
        minute=0, second=0, microsecond=0
    )
    assert manual.data_interval_end - manual.data_interval_start == dt.timedelta(hours=1)


def test_triggering_a_paused_dag_says_the_run_waits(
    settings: Settings, make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag()
    run("dags", "pause", dag_id)
    result = run("dags", "trigger", dag_id)
    assert result.exit_code == 0
    assert f"DAG {dag_id} is paused: the run waits until `deferral dags unpause {dag_id}`" in (
        result.output
    )


def test_trigger_reads_the_last_parse_and_render_names_a_file_that_fails_to_import(
    settings: Settings, sessions: sessionmaker[Session], make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag()
    path = Path(settings.dags_folder) / f"{dag_id}.py"
    path.write_text(path.read_text() + "\nundefined_name\n")

    # A trigger and next-run read the document the last parse stored: the file is not imported.
    result = run("dags", "trigger", dag_id, "--run-id", "r")
    assert result.exit_code == 0 and f"triggered {dag_id} r" in result.output
    assert run("dags", "next-run", dag_id).exit_code == 0
    # Rendering a task runs the DAG's code: it imports the file.
    result = run("tasks", "render", dag_id, "r", "a")
    assert result.exit_code == 1
    assert result.output.startswith(f"error: DAG '{dag_id}' is in {path}, which fails to import: ")
    assert "NameError" in result.output and "undefined_name" in result.output

    # A DAG no scheduler has parsed: not found.
    result = run("dags", "trigger", "never_seen")
    assert (result.exit_code, result.output) == (
        1,
        f"error: DAG 'never_seen' not found in {settings.dags_folder}\n",
    )


def test_latest_names_the_newest_run_in_every_command_taking_a_run_id(
    settings: Settings, make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag()
    assert run("runs", "show", dag_id, "latest").output == f"error: DAG {dag_id!r} has no runs\n"
    run("dags", "backfill", dag_id, "-s", "2024-01-01", "-e", "2024-01-02")
    newest = f"backfill__{day(2).isoformat()}"
    shown = run("runs", "show", dag_id, "latest")
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines()[0].startswith(f"{dag_id} {newest}: ")
    assert run("xcom", "list", dag_id, "latest").output == "no XComs\n"
    # A run that is called latest is that run.
    run("dags", "trigger", dag_id, "--run-id", "latest")
    assert run("runs", "show", dag_id, "latest").output.startswith(f"{dag_id} latest: ")


def test_runs_list_shows_newest_first_and_filters(
    settings: Settings, sessions: sessionmaker[Session], make_dag: Callable[..., str]
) -> None:
    dag_id = make_dag()
    other = make_dag()
    run("dags", "backfill", dag_id, "-s", "2024-01-01", "-e", "2024-01-02")
    run("dags", "backfill", other, "-s", "2024-01-03", "-e", "2024-01-03")
    result = run("runs", "list", dag_id)
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split() == [
        "DAG_ID",
        "RUN_ID",
        "RUN_TYPE",
        "STATE",
        "LOGICAL_DATE",
        "DATA_INTERVAL_START",
        "DATA_INTERVAL_END",
        "START_DATE",
        "END_DATE",
    ]
    assert [row.split()[1] for row in rows] == [
        f"backfill__{day(2).isoformat()}",
        f"backfill__{day(1).isoformat()}",
    ]
    assert rows[0].split()[2:7] == [
        "backfill",
        "queued",
        day(2).isoformat(),
        day(2).isoformat(),
        day(3).isoformat(),
    ]
    everything = run("runs", "list").output
    assert dag_id in everything and other in everything
    assert "no runs" in run("runs", "list", dag_id, "--state", "success").output


def test_runs_list_refuses_an_unknown_dag_or_state(settings: Settings) -> None:
    unknown = run("runs", "list", "nope")
    assert unknown.exit_code == 1 and "error: DAG 'nope' not found" in unknown.output
    bad_state = run("runs", "list", "--state", "sleeping")
    assert bad_state.exit_code == 2 and "'sleeping' is not one of" in bad_state.output
