"""deferral.loading.parsing: reading the DAGs folder through a parse child, each file within
the import timeout, so that no file can stop the reader."""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deferral.loading import parsing
from deferral.loading.dagbag import DAG_MODULE_PREFIX, DagBag
from deferral.loading.parsing import FolderParser
from deferral.runtime.process import raising_after

GOOD = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{dag_id}") as dag:
    EmptyOperator(task_id="t")
"""
SLEEPS_FOR_EVER = "import time\nwhile True:\n    time.sleep(0.05)\n"
# Blind to the alarm: only killing the child stops it.
IGNORES_THE_ALARM = (
    "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n" + SLEEPS_FOR_EVER
)
EXITS = "import os\nos._exit(3)\n"


@pytest.fixture(autouse=True)
def _isolate_import_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield
    for name in [n for n in sys.modules if n.startswith(DAG_MODULE_PREFIX)]:
        del sys.modules[name]


def _folder(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    for name, source in files.items():
        (folder / name).write_text(textwrap.dedent(source))
    return folder.resolve()


def test_a_file_that_never_finishes_is_an_import_error_after_the_timeout(tmp_path: Path) -> None:
    folder = _folder(
        tmp_path, {"a_sleeps.py": SLEEPS_FOR_EVER, "b_good.py": GOOD.format(dag_id="good")}
    )
    parser = FolderParser(DagBag(folder), timeout=0.5)
    began = time.monotonic()
    parsed = parser.parse()
    took = time.monotonic() - began
    assert set(parsed.dags) == {"good"}
    assert parsed.import_errors == {
        str(folder / "a_sleeps.py"): "DagImportTimeout: importing the file took longer than "
        "0.5 s (DEFERRAL_DAGBAG_IMPORT_TIMEOUT) (line 3)"
    }
    assert took < 0.5 + 10  # the timeout, and the fork and imports on a loaded machine
    # Unchanged since, it is not imported again: the next read costs no timeout.
    began = time.monotonic()
    again = parser.parse()
    assert again.import_errors == parsed.import_errors
    assert time.monotonic() - began < 0.5


def test_a_child_deaf_to_the_alarm_is_killed_and_the_files_after_it_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parsing, "KILL_GRACE_SEC", 0.3)
    folder = _folder(
        tmp_path,
        {
            "a_deaf.py": IGNORES_THE_ALARM,
            "b_exits.py": EXITS,
            "c_good.py": GOOD.format(dag_id="after_them"),
        },
    )
    parsed = FolderParser(DagBag(folder), timeout=0.3).parse()
    assert set(parsed.dags) == {"after_them"}
    assert parsed.import_errors == {
        str(folder / "a_deaf.py"): "DagImportTimeout: importing the file took longer than "
        "0.3 s (DEFERRAL_DAGBAG_IMPORT_TIMEOUT)",
        str(folder / "b_exits.py"): "the parse child exited (status 3) importing the file",
    }


def test_a_background_read_hands_its_result_over_once(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"good.py": GOOD.format(dag_id="in_background")})
    parser = FolderParser(DagBag(folder), timeout=5)
    assert parser.take() is None
    parser.start()
    assert parser.wait(30)
    parsed = parser.take()
    assert parsed is not None and set(parsed.dags) == {"in_background"}
    assert parser.take() is None


def test_an_import_timeout_inside_a_task_timeout_leaves_the_task_timeout_armed() -> None:
    """A task that loads another DAG (TriggerDagRunOperator) within its execution_timeout."""

    class TaskTimeout(Exception):
        pass

    with pytest.raises(TaskTimeout), raising_after(0.4, TaskTimeout):
        with raising_after(30, RuntimeError):
            pass  # a DAG file imported in time
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
    assert time.monotonic() < deadline


def test_a_closed_parser_forks_no_child_and_imports_nothing(tmp_path: Path) -> None:
    """A stopping process: a read under way ends without importing what is left."""
    folder = _folder(
        tmp_path, {"a_sleeps.py": SLEEPS_FOR_EVER, "b_good.py": GOOD.format(dag_id="b")}
    )
    parser = FolderParser(DagBag(folder), timeout=30)
    parser.close()
    parsed = parser.parse()
    assert (parsed.dags, parsed.import_errors) == ({}, {})


def test_a_slow_file_holds_back_no_other_file_of_a_background_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files after it are read by another child meanwhile, and handed over at once (an
    interim read); the slow file's outcome follows in the final read."""
    monkeypatch.setattr(parsing, "INTERIM_AFTER_SEC", 0.3)
    folder = _folder(
        tmp_path,
        {
            "a_sleeps.py": SLEEPS_FOR_EVER,
            "b_good.py": GOOD.format(dag_id="b"),
            "c_good.py": GOOD.format(dag_id="c"),
        },
    )
    parser = FolderParser(DagBag(folder), timeout=1.5)
    parser.start()
    assert parser.wait(30)
    interim = parser.take()
    assert interim is not None
    assert (set(interim.dags), interim.import_errors) == ({"b", "c"}, {})
    assert interim.pending == {str(folder / "a_sleeps.py")}
    assert parser.wait(30)
    final = parser.take()
    assert final is not None
    assert (set(final.dags), final.pending) == ({"b", "c"}, frozenset())
    assert list(final.import_errors) == [str(folder / "a_sleeps.py")]
