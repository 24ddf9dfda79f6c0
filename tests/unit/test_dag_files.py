"""DAG files as Airflow has them: .deferralignore (regexp and glob syntaxes), zipped DAGs, and
cluster policies from deferral_local_settings.

Module names are cached in sys.modules, so every module written here has a unique name.
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
import os
import subprocess
import sys
import textwrap
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from deferral.exceptions import ClusterPolicyError
from deferral.loading.dagbag import DagBag, dag_module_name, dag_sources
from deferral.loading.policies import (
    LOCAL_SETTINGS_MODULE,
    ClusterPolicies,
    MutableTaskInstance,
    apply_task_instance_mutation_hook,
    load_policies,
    mutate_task_instance,
)
from deferral.operators import EmptyOperator
from deferral.store.transitions import NewTaskInstance
from deferral.trigger_rules import TriggerRule
from deferral.triggers.base import classpath_of


@pytest.fixture(autouse=True)
def _isolate_import_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DagBag puts folders and archives on sys.path, a finder on sys.meta_path, and imports
    modules (deferral_local_settings among them): undo all of it afterwards."""
    # A DAGs folder goes at the end of sys.path: one another test of the process left there
    # with its own deferral_local_settings would be found before this test's folder.
    monkeypatch.setattr(
        sys,
        "path",
        [p for p in sys.path if not (Path(p) / f"{LOCAL_SETTINGS_MODULE}.py").is_file()],
    )
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv("DEFERRAL_DAG_IGNORE_FILE_SYNTAX", raising=False)
    # ... and one it imported would be found again in sys.modules.
    monkeypatch.delitem(sys.modules, LOCAL_SETTINGS_MODULE, raising=False)
    importlib.invalidate_caches()
    before = set(sys.modules)
    load_policies.cache_clear()
    yield
    load_policies.cache_clear()
    for name in set(sys.modules) - before:
        if name.startswith(("dagfile_t_", LOCAL_SETTINGS_MODULE)):
            del sys.modules[name]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "dags"
    path.mkdir()
    return path


def unique(stem: str) -> str:
    return f"dagfile_t_{stem}_{uuid.uuid4().hex[:10]}"


def dag_source(dag_id: str, **task_args: object) -> str:
    args = "".join(f", {k}={v!r}" for k, v in task_args.items())
    return textwrap.dedent(
        f"""
        from deferral import DAG
        from deferral.operators import EmptyOperator

        with DAG({dag_id!r}) as dag:
            EmptyOperator(task_id="t"{args})
        """
    )


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def write_dag(directory: Path, dag_id: str, stem: str | None = None) -> Path:
    return write(directory / f"{unique(stem or dag_id)}.py", dag_source(dag_id))


def found(folder: Path, syntax: str | None = None) -> set[str]:
    return set(DagBag(folder, ignore_syntax=syntax).collect().dags)


# -- .deferralignore, regexp syntax (the default) ---------------------------------------------


def test_regexp_ignore_leaves_files_out_and_never_imports_them(folder: Path) -> None:
    write_dag(folder, "kept")
    write(folder / f"{unique('scratch')}.py", "raise RuntimeError('must not be imported')\n")
    (folder / ".deferralignore").write_text("scratch\n")
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"kept"}
    assert bag.import_errors == {}


def test_regexp_is_searched_in_the_path_relative_to_the_dags_folder(folder: Path) -> None:
    write_dag(folder / "team_a", "a_new", "new")
    write_dag(folder / "team_a", "a_old", "old")
    write_dag(folder / "team_b", "b_old", "old")
    (folder / ".deferralignore").write_text("^team_a/.*old\n")
    assert found(folder) == {"a_new", "b_old"}


def test_an_ignored_folder_is_not_entered(folder: Path) -> None:
    write_dag(folder, "top")
    write(folder / "vendor" / f"{unique('broken')}.py", "raise RuntimeError('no')\n")
    (folder / ".deferralignore").write_text("vendor\n")
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"top"}
    assert bag.import_errors == {}


def test_a_subfolders_ignore_file_applies_below_it_only(folder: Path) -> None:
    write_dag(folder, "legacy_top", "legacy")
    write_dag(folder / "sub", "legacy_sub", "legacy")
    write_dag(folder / "sub" / "deeper", "legacy_deeper", "legacy")
    write_dag(folder / "sub", "current_sub", "current")
    (folder / "sub" / ".deferralignore").write_text("legacy\n")
    assert found(folder) == {"legacy_top", "current_sub"}


def test_comments_blank_lines_and_bad_regexps(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_dag(folder, "alpha", "alpha")
    write_dag(folder, "beta", "beta")
    write_dag(folder, "gamma", "gamma")
    (folder / ".deferralignore").write_text(
        "# whole-line comment\n\n  \nalpha   # trailing comment\n([unclosed\nbeta\n"
    )
    with caplog.at_level(logging.WARNING, logger="deferral.loading.dagbag"):
        assert found(folder) == {"gamma"}
    assert "([unclosed" in caplog.text


def test_an_unreadable_ignore_file_is_logged_and_does_not_stop_the_scan(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_dag(folder, "still_loaded")
    (folder / ".deferralignore").write_bytes(b"\xff\xfe not utf-8 \x80")
    with caplog.at_level(logging.WARNING, logger="deferral.loading.dagbag"):
        assert found(folder) == {"still_loaded"}
    assert "cannot be read" in caplog.text


def test_a_link_back_up_the_tree_is_read_once(folder: Path) -> None:
    write_dag(folder / "sub", "once")
    (folder / "sub" / "loop").symlink_to(folder, target_is_directory=True)
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"once"}
    assert bag.import_errors == {}


# -- .deferralignore, glob syntax -------------------------------------------------------------


def test_glob_name_patterns_match_at_any_depth_and_negation_re_includes(folder: Path) -> None:
    (folder / "a").mkdir()
    write(folder / "a" / "tmp_one.py", dag_source("tmp_one"))
    write(folder / "tmp_two.py", dag_source("tmp_two"))
    write(folder / "tmp_keep.py", dag_source("tmp_keep"))
    write_dag(folder, "plain")
    (folder / ".deferralignore").write_text("tmp_*.py\n!tmp_keep.py\n")
    assert found(folder, "glob") == {"tmp_keep", "plain"}
    # As regexps the same lines match none of these paths ("tmp_*.py": "tmp", any number of
    # "_", one character, "py"), so regexp, the default, ignores nothing here.
    assert found(folder, "regexp") == {"tmp_one", "tmp_two", "tmp_keep", "plain"}


def test_glob_anchored_and_directory_patterns(folder: Path) -> None:
    write_dag(folder, "only_here_top", "only_here")
    write(folder / "only_here.py", dag_source("anchored"))
    write(folder / "sub" / "only_here.py", dag_source("anchored_in_sub"))
    write(folder / "build" / "made.py", dag_source("in_build_dir"))
    write(folder / "src" / "build.py", dag_source("file_named_build"))
    (folder / ".deferralignore").write_text("/only_here.py\nbuild/\n")
    assert found(folder, "glob") == {"only_here_top", "anchored_in_sub", "file_named_build"}


def test_glob_patterns_of_a_subfolder_are_relative_to_it(folder: Path) -> None:
    write(folder / "x.py", dag_source("root_x"))
    write(folder / "sub" / "x.py", dag_source("sub_x"))
    write(folder / "sub" / "inner" / "x.py", dag_source("inner_x"))
    (folder / "sub" / ".deferralignore").write_text("/x.py\n")
    assert found(folder, "glob") == {"root_x", "inner_x"}


def test_syntax_comes_from_the_environment(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(folder / "draft_one.py", dag_source("draft_one"))
    (folder / ".deferralignore").write_text("draft_*\n")
    monkeypatch.setenv("DEFERRAL_DAG_IGNORE_FILE_SYNTAX", "glob")
    assert dag_sources(folder) == []
    monkeypatch.setenv("DEFERRAL_DAG_IGNORE_FILE_SYNTAX", "regexp")
    assert dag_sources(folder) == []  # "draft_*" as a regexp also finds "draft"
    (folder / ".deferralignore").write_text("draft_one.py$\n")
    monkeypatch.setenv("DEFERRAL_DAG_IGNORE_FILE_SYNTAX", "glob")
    assert dag_sources(folder) == [folder.resolve() / "draft_one.py"]


# -- zipped DAGs ----------------------------------------------------------------------------------


def make_zip(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, source in files.items():
            archive.writestr(name, textwrap.dedent(source))
    return path


@pytest.fixture
def names() -> dict[str, str]:
    return {k: unique(k) for k in ("dag", "triggers", "helpers", "other")}


def packaged(names: dict[str, str], dag_id: str = "zipped") -> dict[str, str]:
    """A DAG module, a trigger module and a helper package, as a team would zip them."""
    return {
        f"{names['dag']}.py": f"""
            from deferral import DAG, BaseOperator
            from {names["helpers"]}.naming import task_name
            from {names["triggers"]} import Ready

            class WaitsForReady(BaseOperator):
                def execute(self, context):
                    self.defer(trigger=Ready(), method_name="done")

                def done(self, context, event=None):
                    return event

            with DAG({dag_id!r}) as dag:
                WaitsForReady(task_id=task_name())
            """,
        f"{names['triggers']}.py": """
            from deferral.triggers import BaseTrigger, TriggerEvent
            from deferral.triggers.base import classpath_of

            class Ready(BaseTrigger):
                def serialize(self):
                    return classpath_of(Ready), {}

                async def run(self):
                    yield TriggerEvent("ready")
            """,
        f"{names['helpers']}/__init__.py": "",
        f"{names['helpers']}/naming.py": "def task_name():\n    return 'wait_in_zip'\n",
        f"{names['helpers']}/nested_dag.py": dag_source("not_top_level"),
    }


def test_a_zipped_dag_loads_with_modules_importable_from_the_zip(
    folder: Path, names: dict[str, str]
) -> None:
    archive = make_zip(folder / "team.zip", packaged(names))
    bag = DagBag(folder).collect()
    assert bag.import_errors == {}
    assert set(bag.dags) == {"zipped"}  # a DAG in a folder of the zip is not a DAG file
    dag = bag.dags["zipped"]
    assert dag.fileloc == str(archive.resolve() / f"{names['dag']}.py")
    task = dag.get_task("wait_in_zip")
    # The DAG module runs under its own name; the modules it imports keep theirs.
    dag_module = dag_module_name(folder.resolve(), archive.resolve(), names["dag"])
    assert type(task).__module__ == dag_module
    trigger_cls = sys.modules[names["triggers"]].Ready
    assert classpath_of(trigger_cls) == f"{names['triggers']}.Ready"
    assert importlib.import_module(names["triggers"]).Ready is trigger_cls


def test_a_zipped_trigger_is_importable_in_a_process_that_never_loaded_the_dags(
    folder: Path, names: dict[str, str]
) -> None:
    """What the triggerer does: put the folder on sys.path, then import the classpath."""
    make_zip(folder / "team.zip", packaged(names))
    script = (
        "import importlib, pathlib, sys\n"
        "from deferral.loading.dagbag import put_on_sys_path\n"
        "put_on_sys_path(pathlib.Path(sys.argv[1]))\n"
        "module = importlib.import_module(sys.argv[2])\n"
        "print(module.Ready.__module__, module.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(folder), names["triggers"]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        names["triggers"],
        str(folder.resolve() / "team.zip" / f"{names['triggers']}.py"),
    ]


def test_a_broken_module_in_a_zip_is_an_import_error_for_that_module(
    folder: Path, names: dict[str, str]
) -> None:
    files = packaged(names)
    files[f"{names['other']}.py"] = "x = 1\nraise ValueError('bad zipped dag')\n"
    archive = make_zip(folder / "team.zip", files)
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"zipped"}
    assert bag.import_errors == {str(archive.resolve()): "ValueError: bad zipped dag (line 2)"}


def test_a_changed_zip_is_read_again(folder: Path, names: dict[str, str]) -> None:
    archive = make_zip(folder / "team.zip", packaged(names, "first_version"))
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"first_version"}
    make_zip(archive, packaged(names, "second_version"))
    stat = archive.stat()
    os.utime(archive, (stat.st_atime + 10, stat.st_mtime + 10))
    assert set(bag.collect().dags) == {"second_version"}


def test_one_module_name_in_two_places_is_an_error(folder: Path, names: dict[str, str]) -> None:
    make_zip(folder / "a.zip", packaged(names))
    clash = write(folder / f"{names['triggers']}.py", dag_source("file_dag"))
    bag = DagBag(folder).collect()
    # Files come before archives on sys.path, so the file keeps the name.
    assert set(bag.dags) == {"file_dag"}
    error = bag.import_errors[str((folder / "a.zip").resolve())]
    assert f"module {names['triggers']!r} is also defined in {clash.resolve()}" == error


def test_a_corrupt_or_ignored_zip(folder: Path, names: dict[str, str]) -> None:
    (folder / "corrupt.zip").write_bytes(b"not a zip at all")
    make_zip(folder / "skipped.zip", packaged(names))
    (folder / ".deferralignore").write_text(r"skipped\.zip$" + "\n")
    bag = DagBag(folder).collect()
    assert bag.dags == {}
    assert list(bag.import_errors) == [str((folder / "corrupt.zip").resolve())]
    assert bag.import_errors[str((folder / "corrupt.zip").resolve())].startswith("BadZipFile")


# -- cluster policies -----------------------------------------------------------------------------


def local_settings(folder: Path, source: str) -> Path:
    return write(folder / f"{LOCAL_SETTINGS_MODULE}.py", source)


def test_task_policy_from_local_settings_in_the_dags_folder_is_applied(folder: Path) -> None:
    local_settings(
        folder,
        """
        def task_policy(task):
            if task.retries == 0:
                task.retries = 3
        """,
    )
    write_dag(folder, "policed")
    bag = DagBag(folder).collect()
    assert bag.import_errors == {}
    assert set(bag.dags) == {"policed"}  # the local settings module is not a DAG file
    assert bag.dags["policed"].get_task("t").retries == 3


def test_policies_run_once_per_load_of_a_file(folder: Path) -> None:
    local_settings(
        folder,
        """
        def task_policy(task):
            task.retries += 1
        """,
    )
    write_dag(folder, "counted")
    bag = DagBag(folder).collect()
    bag.collect()
    assert bag.get_dag("counted").get_task("t").retries == 1


def test_dag_policy_violation_is_an_import_error_naming_the_policy(folder: Path) -> None:
    local_settings(
        folder,
        """
        from deferral.exceptions import ClusterPolicyViolation

        def dag_policy(dag):
            if not dag.dag_id.startswith("team_"):
                raise ClusterPolicyViolation("DAG ids must start with team_")
        """,
    )
    refused = write_dag(folder, "rogue")
    write_dag(folder, "team_ok")
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"team_ok"}
    assert bag.import_errors == {
        str(refused): "ClusterPolicyViolation: deferral_local_settings.dag_policy refused "
        "DAG 'rogue': DAG ids must start with team_"
    }


def test_a_policy_that_fails_otherwise_is_a_cluster_policy_error(folder: Path) -> None:
    local_settings(
        folder,
        """
        def task_policy(task):
            raise KeyError("owner")
        """,
    )
    path = write_dag(folder, "any")
    error = DagBag(folder).collect().import_errors[str(path)]
    assert error == (
        "ClusterPolicyError: deferral_local_settings.task_policy raised KeyError "
        "on task 't' of DAG 'any': 'owner'"
    )


def test_skip_dag_leaves_the_dag_out_quietly(folder: Path) -> None:
    local_settings(
        folder,
        """
        from deferral.exceptions import ClusterPolicySkipDag

        def dag_policy(dag):
            if "skip" in dag.dag_id:
                raise ClusterPolicySkipDag()
        """,
    )
    write_dag(folder, "please_skip")
    write_dag(folder, "keep")
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"keep"}
    assert bag.import_errors == {}


def test_values_a_policy_leaves_are_checked(folder: Path) -> None:
    local_settings(
        folder,
        """
        def task_policy(task):
            task.trigger_rule = "all_done"
            if task.dag.dag_id == "bad_retries":
                task.retries = -1
        """,
    )
    bad = write_dag(folder, "bad_retries")
    write_dag(folder, "good")
    bag = DagBag(folder).collect()
    assert bag.dags["good"].get_task("t").trigger_rule is TriggerRule.ALL_DONE
    assert bag.import_errors[str(bad)] == (
        "ClusterPolicyError: after the cluster policies, task 't' of DAG 'bad_retries': "
        "retries must be an int >= 0, got -1"
    )


def test_broken_local_settings_load_no_dag_at_all(folder: Path) -> None:
    settings = local_settings(folder, "import surely_not_a_module_xyz\n")
    write_dag(folder, "would_load")
    bag = DagBag(folder).collect()
    assert bag.dags == {}
    assert bag.import_errors[str(settings)].startswith("ModuleNotFoundError: ")


def test_a_policy_that_is_not_callable_is_refused(folder: Path) -> None:
    settings = local_settings(folder, "dag_policy = 'strict'\n")
    bag = DagBag(folder).collect()
    assert bag.import_errors == {
        str(settings): "ClusterPolicyError: deferral_local_settings.dag_policy is not callable"
    }


def test_no_local_settings_means_no_policies(folder: Path) -> None:
    put = DagBag(folder).collect()
    assert put.import_errors == {}
    assert load_policies() == ClusterPolicies()


# -- task_instance_mutation_hook --------------------------------------------------------------


NEW = NewTaskInstance(
    task_id="t", max_tries=1, pool="default_pool", pool_slots=1, queue="default", priority_weight=1
)


def test_mutation_hook_changes_the_new_task_instance() -> None:
    seen: list[MutableTaskInstance] = []

    def hook(ti: MutableTaskInstance) -> None:
        seen.append(ti)
        if ti.task.task_id == "t":
            ti.queue, ti.pool, ti.priority_weight, ti.max_tries = "gpu", "gpus", 50, 4

    task = EmptyOperator(task_id="t")
    mutated = mutate_task_instance(NEW, dag_id="d", run_id="r", task=task, hook=hook)
    assert mutated == NewTaskInstance(
        task_id="t", max_tries=4, pool="gpus", pool_slots=1, queue="gpu", priority_weight=50
    )
    assert (seen[0].dag_id, seen[0].run_id, seen[0].map_index, seen[0].try_number) == (
        "d",
        "r",
        -1,
        0,
    )


def test_mutation_hook_that_raises_or_sets_a_bad_value_is_named() -> None:
    task = EmptyOperator(task_id="t")

    def raises(ti: MutableTaskInstance) -> None:
        raise RuntimeError("no queue map")

    with pytest.raises(ClusterPolicyError, match="task_instance_mutation_hook raised RuntimeError"):
        mutate_task_instance(NEW, dag_id="d", run_id="r", task=task, hook=raises)

    def bad_slots(ti: MutableTaskInstance) -> None:
        ti.pool_slots = 0

    with pytest.raises(ClusterPolicyError, match=r"task instance d\.r\.t: pool_slots must be"):
        mutate_task_instance(NEW, dag_id="d", run_id="r", task=task, hook=bad_slots)


def test_the_scheduler_entry_point_keeps_the_values_when_the_hook_fails(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local_settings(
        folder,
        """
        def task_instance_mutation_hook(ti):
            if ti.task_id == "boom":
                raise ValueError("hook bug")
            ti.queue = "rerouted"
        """,
    )
    DagBag(folder).collect()  # puts the folder on sys.path, as in the scheduler
    task = EmptyOperator(task_id="t")
    rerouted = apply_task_instance_mutation_hook(NEW, dag_id="d", run_id="r", task=task)
    assert rerouted.queue == "rerouted"
    boom = NewTaskInstance(**{**NEW.__dict__, "task_id": "boom"})
    with caplog.at_level(logging.ERROR, logger="deferral.loading.policies"):
        kept = apply_task_instance_mutation_hook(boom, dag_id="d", run_id="r", task=task)
    assert kept == boom
    assert "task_instance_mutation_hook raised ValueError on task instance d.r.boom" in caplog.text


# -- the examples ---------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_examples_load_and_their_ignore_file_leaves_out_the_sources() -> None:
    bag = DagBag(EXAMPLES).collect()
    assert bag.import_errors == {}
    assert {
        "example_sensors",
        "example_deferrable",
        "example_mapping",
        "example_setup_teardown",
    } <= set(bag.dags)
    assert "example_packaged" not in bag.dags  # its sources are ignored, not loaded


def test_the_packaged_example_zips_into_a_dag(tmp_path: Path) -> None:
    folder = tmp_path / "dags"
    folder.mkdir()
    source = EXAMPLES / "packaged"
    with zipfile.ZipFile(folder / "example_packaged.zip", "w") as archive:
        for path in sorted(source.rglob("*.py")):
            archive.write(path, path.relative_to(source).as_posix())
    bag = DagBag(folder).collect()
    assert bag.import_errors == {}
    task = bag.dags["example_packaged"].get_task("countdown")
    trigger = sys.modules["example_packaged_lib.triggers"].CountdownTrigger(3)
    assert trigger.serialize() == ("example_packaged_lib.triggers.CountdownTrigger", {"seconds": 3})
    assert type(task).__name__ == "Countdown"
    for name in ("example_packaged_dag", "example_packaged_lib", "example_packaged_lib.triggers"):
        sys.modules.pop(name, None)


def test_the_example_policies(folder: Path) -> None:
    local_settings(folder, (EXAMPLES / "policies" / f"{LOCAL_SETTINGS_MODULE}.py").read_text())
    write_dag(folder, "good_one")
    write_dag(folder, "parked_disabled")
    bad = write_dag(folder, "Bad-Name")
    bag = DagBag(folder).collect()
    assert set(bag.dags) == {"good_one"}
    assert "DAG id 'Bad-Name' is not lower_snake_case" in bag.import_errors[str(bad)]
    task = bag.dags["good_one"].get_task("t")
    assert (task.retries, task.execution_timeout) == (1, dt.timedelta(hours=1))
    urgent = NewTaskInstance(**{**NEW.__dict__, "task_id": "urgent_fix"})
    bumped = apply_task_instance_mutation_hook(urgent, dag_id="d", run_id="r", task=task)
    assert bumped.priority_weight == 101
