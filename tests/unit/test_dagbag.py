"""deferral.loading.dagbag: finding DAGs in a folder of Python files.

Module names are cached in sys.modules, so every file written here has a unique name.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deferral.dag import DAG
from deferral.loading.dagbag import DAG_MODULE_PREFIX, DagBag, DagNotFound, dag_module_name

WriteDag = Callable[..., tuple[Path, str]]


@pytest.fixture(autouse=True)
def _isolate_import_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DagBag puts its folder on sys.path (and a finder on sys.meta_path) and imports modules:
    undo it all afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        module = sys.modules.get(name)
        if module is not None and ("dagbag_t_" in name or name.startswith(DAG_MODULE_PREFIX)):
            del sys.modules[name]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "dags"
    path.mkdir()
    return path


def unique(stem: str) -> str:
    return f"dagbag_t_{stem}_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def write(folder: Path) -> WriteDag:
    def write(stem: str, source: str, *, sub: str | None = None) -> tuple[Path, str]:
        name = unique(stem)
        directory = folder / sub if sub else folder
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path, name

    return write


def bump_mtime(path: Path) -> None:
    stat = path.stat()
    os.utime(path, (stat.st_atime + 10, stat.st_mtime + 10))


SIMPLE = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{dag_id}") as dag:
    EmptyOperator(task_id="{task_id}")
"""


def simple(dag_id: str, task_id: str = "t") -> str:
    return SIMPLE.format(dag_id=dag_id, task_id=task_id)


def test_collect_finds_module_global_dags(folder: Path, write: WriteDag) -> None:
    path, _ = write(
        "two",
        """
        from deferral import DAG
        from deferral.operators import EmptyOperator

        first = DAG("first")
        EmptyOperator(task_id="a", dag=first)
        second = DAG("second")

        def factory():
            return DAG("hidden_in_function")

        _ = factory
        """,
    )
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"first", "second"}
    assert bag.import_errors == {}
    assert bag.dags["first"].fileloc == str(path)
    assert set(bag.dags["first"].task_dict) == {"a"}
    assert isinstance(bag.dags["second"], DAG)


def test_collect_returns_self_and_empty_folder_is_empty(folder: Path) -> None:
    bag = DagBag(folder)
    assert bag.collect() is bag
    assert bag.dags == {}
    assert bag.import_errors == {}


def test_files_in_subfolders_are_found_and_private_ones_skipped(
    folder: Path, write: WriteDag
) -> None:
    sub = unique("sub")
    write("nested", simple("nested"), sub=sub)
    write("private", simple("private"), sub="_private")
    hidden = folder / f"_{unique('under')}.py"
    hidden.write_text(simple("underscored"))
    (folder / "notes.txt").write_text(simple("not_python"))
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"nested"}
    assert bag.import_errors == {}


def test_broken_file_reports_one_line_without_affecting_others(
    folder: Path, write: WriteDag
) -> None:
    write("good_a", simple("good_a"))
    broken, _ = write(
        "broken",
        """
        x = 1

        raise RuntimeError("boom")
        """,
    )
    write("good_z", simple("good_z"))
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"good_a", "good_z"}
    assert set(bag.import_errors) == {str(broken)}
    error = bag.import_errors[str(broken)]
    assert error == "RuntimeError: boom (line 4)"


def test_import_error_of_missing_module(folder: Path, write: WriteDag) -> None:
    broken, _ = write("missing", "import surely_not_a_module_xyz\n")
    bag = DagBag(folder).collect()
    error = bag.import_errors[str(broken)]
    assert error.startswith("ModuleNotFoundError: ")
    assert "surely_not_a_module_xyz" in error


def test_import_error_line_is_the_dag_files_line(folder: Path, write: WriteDag) -> None:
    broken, _ = write(
        "badid",
        """
        from deferral import DAG

        x = 1
        dag = DAG("bad id!")
        """,
    )
    error = DagBag(folder).collect().import_errors[str(broken)]
    assert error.startswith("DagDefinitionError: ")
    assert error.endswith("(line 5)")


def test_syntax_error_reports_its_line(folder: Path, write: WriteDag) -> None:
    broken, _ = write("syntax", "x = 1\ndef f(:\n    pass\n")
    bag = DagBag(folder).collect()
    error = bag.import_errors[str(broken)]
    assert error.startswith("SyntaxError: ")
    assert re.findall(r"line (\d+)", error) and set(re.findall(r"line (\d+)", error)) == {"2"}


def test_syntax_error_does_not_stop_other_files(folder: Path, write: WriteDag) -> None:
    broken, _ = write("syntax2", "def f(:\n")
    write("fine", simple("fine_dag"))
    bag = DagBag(folder).collect()
    assert "fine_dag" in bag.dags
    assert bag.import_errors[str(broken)].startswith("SyntaxError")


def test_import_error_is_one_line_even_for_multiline_messages(
    folder: Path, write: WriteDag
) -> None:
    broken, _ = write("multiline", 'raise ValueError("first\\nsecond")\n')
    error = DagBag(folder).collect().import_errors[str(broken)]
    assert "\n" not in error
    assert error.startswith("ValueError: first")


def test_duplicate_dag_id_across_files(folder: Path, write: WriteDag) -> None:
    first, first_name = write("aaa_dup", simple("shared_id", "from_first"))
    second, second_name = write("zzz_dup", simple("shared_id", "from_second"))
    assert first_name < second_name  # files are read in sorted order
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"shared_id"}
    assert set(bag.dags["shared_id"].task_dict) == {"from_first"}
    assert bag.dags["shared_id"].fileloc == str(first)
    error = bag.import_errors[str(second)]
    assert "'shared_id'" in error
    assert str(first) in error


def test_dag_with_cycle_is_an_error_not_a_dag(folder: Path, write: WriteDag) -> None:
    path, _ = write(
        "cycle",
        """
        from deferral import DAG
        from deferral.operators import EmptyOperator

        with DAG("cyclic") as dag:
            a = EmptyOperator(task_id="a")
            b = EmptyOperator(task_id="b")
            a >> b >> a
        """,
    )
    write("ok", simple("acyclic"))
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"acyclic"}
    assert "cycle" in bag.import_errors[str(path)]


def test_changed_file_is_reimported(folder: Path, write: WriteDag) -> None:
    path, _ = write("changing", simple("changing", "old_task"))
    bag = DagBag(folder).collect()
    first = bag.dags["changing"]
    assert set(first.task_dict) == {"old_task"}

    bag.collect()
    assert bag.dags["changing"] is first  # unchanged mtime: not re-imported

    path.write_text(textwrap.dedent(simple("changing", "new_task_with_longer_name")))
    bump_mtime(path)
    bag.collect()
    assert bag.dags["changing"] is not first
    assert set(bag.dags["changing"].task_dict) == {"new_task_with_longer_name"}


def test_file_that_breaks_then_recovers(folder: Path, write: WriteDag) -> None:
    path, _ = write("flaky", simple("flaky", "t1"))
    bag = DagBag(folder).collect()
    assert "flaky" in bag.dags

    path.write_text("raise KeyError('gone')\n")
    bump_mtime(path)
    bag.collect()
    assert "flaky" not in bag.dags
    assert bag.import_errors[str(path)].startswith("KeyError: 'gone'")

    path.write_text(textwrap.dedent(simple("flaky", "t2")))
    bump_mtime(path)
    bump_mtime(path)
    bag.collect()
    assert bag.import_errors == {}
    assert set(bag.dags["flaky"].task_dict) == {"t2"}


def test_deleted_file_drops_its_dag(folder: Path, write: WriteDag) -> None:
    path, _ = write("deleted", simple("deleted_dag"))
    bag = DagBag(folder).collect()
    assert "deleted_dag" in bag.dags
    path.unlink()
    bag.collect()
    assert "deleted_dag" not in bag.dags


def test_same_module_name_in_two_folders_loads_each_folders_file(tmp_path: Path) -> None:
    name = unique("same")
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, dag_id in ((one, "from_one"), (two, "from_two")):
        folder.mkdir()
        (folder / f"{name}.py").write_text(textwrap.dedent(simple(dag_id)))
    assert set(DagBag(one).collect().dags) == {"from_one"}
    assert set(DagBag(two).collect().dags) == {"from_two"}


def test_get_dag_found_and_missing(folder: Path, write: WriteDag) -> None:
    write("getme", simple("present"))
    bag = DagBag(folder).collect()
    assert bag.get_dag("present").dag_id == "present"
    with pytest.raises(DagNotFound) as info:
        bag.get_dag("absent")
    assert "'absent'" in str(info.value)
    assert str(folder.resolve()) in str(info.value)


def test_get_dag_collects_on_demand(folder: Path, write: WriteDag) -> None:
    bag = DagBag(folder)
    write("later", simple("added_later"))
    assert bag.get_dag("added_later").dag_id == "added_later"


def test_missing_folder_raises_dag_not_found(tmp_path: Path) -> None:
    with pytest.raises(DagNotFound, match="does not exist"):
        DagBag(tmp_path / "nope").collect()


def test_folder_goes_on_sys_path_once(folder: Path, write: WriteDag) -> None:
    write("path", simple("path_dag"))
    bag = DagBag(folder)
    bag.collect()
    bag.collect()
    assert sys.path.count(str(folder.resolve())) == 1


# -- DAGs no module global holds (Airflow's auto-registration) ---------------------------------


def test_dag_factory_called_at_module_level_and_unassigned_with_block_are_found(
    folder: Path, write: WriteDag
) -> None:
    path, _ = write(
        "unassigned",
        """
        from deferral import DAG, dag, task
        from deferral.operators import EmptyOperator

        @dag(schedule=None)
        def taskflow_style():
            @task
            def step():
                return 1
            step()

        taskflow_style()

        with DAG("with_block_unassigned"):
            EmptyOperator(task_id="e")

        with DAG("opted_out", auto_register=False):
            EmptyOperator(task_id="e")
        """,
    )
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"taskflow_style", "with_block_unassigned"}
    assert bag.import_errors == {}
    assert bag.dags["taskflow_style"].fileloc == str(path)
    # An unchanged file is not re-imported, and its DAGs are still found.
    first = bag.dags["taskflow_style"]
    assert bag.collect().dags["taskflow_style"] is first


def test_a_dag_file_importing_another_does_not_take_its_dags(folder: Path, write: WriteDag) -> None:
    lib_path, lib_name = write(
        "imported",
        """
        from deferral import dag
        from deferral.operators import EmptyOperator

        @dag
        def from_imported():
            EmptyOperator(task_id="e")

        from_imported()
        HELPER = 1
        """,
    )
    # Sorted before the file it imports, so it is imported first, through this file.
    importer = folder / f"aaa_{lib_name}.py"
    importer.write_text(
        textwrap.dedent(
            f"""
            from deferral import dag
            from deferral.operators import EmptyOperator
            from {lib_name} import HELPER

            @dag
            def importer_dag():
                EmptyOperator(task_id="e")

            importer_dag()
            """
        )
    )
    try:
        bag = DagBag(folder).collect()
        assert bag.import_errors == {}
        assert set(bag.dags) == {"from_imported", "importer_dag"}
        assert bag.dags["from_imported"].fileloc == str(lib_path)
        assert bag.dags["importer_dag"].fileloc == str(importer)
    finally:
        sys.modules.pop(f"aaa_{lib_name}", None)


def test_dags_a_shared_library_builds_for_a_dag_file_are_that_files(
    tmp_path: Path, folder: Path, write: WriteDag, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = tmp_path / "lib"
    library.mkdir()
    lib_name = unique("factory_lib")
    (library / f"{lib_name}.py").write_text(
        textwrap.dedent(
            """
            from deferral import DAG
            from deferral.operators import EmptyOperator

            def make(dag_id):
                with DAG(dag_id):
                    EmptyOperator(task_id="e")
            """
        )
    )
    monkeypatch.syspath_prepend(str(library))
    path, _ = write(
        "uses_library",
        f"""
        from {lib_name} import make

        for name in ("made_one", "made_two"):
            make(name)
        """,
    )
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"made_one", "made_two"}
    assert bag.dags["made_one"].fileloc == str(path)


# -- DAG module names ----------------------------------------------------------------------------


def test_a_dag_module_name_is_its_own_and_the_same_in_every_process(folder: Path) -> None:
    top, nested = folder / "json.py", folder / "team" / "json.py"
    name = dag_module_name(folder, top)
    assert name.startswith(DAG_MODULE_PREFIX) and name.endswith("_json")
    assert name == dag_module_name(folder, top)  # a digest of the place, not a random one
    assert dag_module_name(folder, nested) != name
    assert dag_module_name(folder, folder / "a.zip", "json") != dag_module_name(folder, top)
    assert dag_module_name(folder, folder / "my-dag.v2.py").isidentifier()


# Every name a DAG file used to take from the process that read it: our packages, the
# standard library's json, and deferral itself (its DAG files import from it).
HOSTILE_NAMES = ("deferral", "broker", "worker", "scheduler", "triggerer", "webserver", "json")


def test_dag_files_named_like_our_packages_or_the_standard_library_replace_nothing(
    folder: Path,
) -> None:
    for stem in HOSTILE_NAMES:
        (folder / f"{stem}.py").write_text(simple(f"named_{stem}"))
    # Read after json.py: finds the real json.
    (folder / "zz_uses_json.py").write_text(
        "import json\nassert hasattr(json, 'dumps'), json\n" + textwrap.dedent(simple("uses_json"))
    )
    bag = DagBag(folder).collect()
    assert bag.import_errors == {}
    assert set(bag.dags) == {f"named_{stem}" for stem in HOSTILE_NAMES} | {"uses_json"}
    for stem in HOSTILE_NAMES:
        module = sys.modules.get(stem)
        assert module is None or not str(getattr(module, "__file__", "")).startswith(str(folder)), (
            stem
        )
    import json

    assert json.dumps([1]) == "[1]"


def _package(folder: Path, stem: str, naming: str) -> str:
    """A package folder of ``folder`` holding module ``naming`` (its source); its name."""
    package = unique(stem)
    (folder / package).mkdir()
    (folder / package / "__init__.py").write_text("")
    (folder / package / "naming.py").write_text(naming)
    return package


def test_helper_modules_of_the_folder_import_by_their_dotted_path(
    folder: Path, write: WriteDag
) -> None:
    package = _package(folder, "helpers", "def task_id():\n    return 'named'\n")
    write(
        "uses_helper",
        f"""
        from deferral import DAG
        from deferral.operators import EmptyOperator
        from {package}.naming import task_id

        with DAG("uses_helper") as dag:
            EmptyOperator(task_id=task_id())
        """,
    )
    bag = DagBag(folder).collect()
    assert bag.import_errors == {}
    assert list(bag.dags["uses_helper"].task_dict) == ["named"]
    assert sys.modules[f"{package}.naming"].__file__ == str(folder / package / "naming.py")


def test_a_dag_file_in_a_package_folder_imports_relatively(folder: Path, write: WriteDag) -> None:
    package = _package(folder, "team", "TASK_ID = 'relative'\n")
    write(
        "relative",
        """
        from deferral import DAG
        from deferral.operators import EmptyOperator
        from .naming import TASK_ID

        with DAG("relative") as dag:
            EmptyOperator(task_id=TASK_ID)
        """,
        sub=package,
    )
    bag = DagBag(folder).collect()
    assert bag.import_errors == {}
    dag = bag.dags["relative"]
    assert list(dag.task_dict) == ["relative"]
    # As the triggerer imports a class of it: by its DAG module name.
    assert dag.fileloc is not None
    name = dag_module_name(folder.resolve(), Path(dag.fileloc))
    del sys.modules[name]
    assert importlib.import_module(name).TASK_ID == "relative"


def test_a_class_of_a_dag_file_is_importable_by_its_classpath(
    folder: Path, write: WriteDag
) -> None:
    """What the triggerer does with a trigger defined in a DAG file."""
    path, _ = write(
        "defines",
        """
        from deferral import DAG
        from deferral.operators import EmptyOperator

        class Mine(EmptyOperator):
            pass

        with DAG("defines") as dag:
            Mine(task_id="t")
        """,
    )
    bag = DagBag(folder).collect()
    name = type(bag.dags["defines"].get_task("t")).__module__
    assert name == dag_module_name(folder.resolve(), path.resolve())
    del sys.modules[name]
    assert importlib.import_module(name).__file__ == str(path.resolve())


def test_a_file_past_the_import_timeout_is_an_import_error_naming_it(
    folder: Path, write: WriteDag
) -> None:
    slow, _ = write("sleeps", "import time\nwhile True:\n    time.sleep(0.05)\n")
    write("good", simple("good_beside_slow"))
    bag = DagBag(folder, import_timeout=0.3).collect()
    assert set(bag.dags) == {"good_beside_slow"}
    assert bag.import_errors == {
        str(slow.resolve()): "DagImportTimeout: importing the file took longer than 0.3 s "
        "(DEFERRAL_DAGBAG_IMPORT_TIMEOUT) (line 3)"
    }
