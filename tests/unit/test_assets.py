"""Assets as authored: conditions with & and |, what a run consumes, and each bad input refused
in one line naming it."""

from __future__ import annotations

import datetime as dt
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from deferral import DAG
from deferral.assets import (
    Asset,
    AssetAccessControl,
    AssetAll,
    AssetAny,
    AssetError,
    AssetWatcher,
    Dataset,
    event_from_trigger,
    plan_runs,
)
from deferral.operators import EmptyOperator
from deferral.triggers.base import TriggerEvent
from deferral.triggers.event import (
    DirectoryWatchTrigger,
    HttpPollTrigger,
    RedisStreamTrigger,
)
from deferral.triggers.file import DirectoryFileDeleteTrigger, FileDeleteTrigger
from deferral.triggers.temporal import DateTimeTrigger

A, B, C = Asset("a"), Asset("b"), Asset("c")


class _Unsealable(DirectoryWatchTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "deferral.triggers.event.DirectoryWatchTrigger", {"x": object()}

    def __init__(self) -> None:
        super().__init__("/tmp")


def test_a_name_alone_is_its_uri_and_the_other_way_round_and_dataset_is_an_alias() -> None:
    assert (Asset("x").name, Asset("x").uri) == ("x", "x")
    assert Asset(uri="s3://b/k").name == "s3://b/k"
    assert Dataset("x") == Asset("x")


def test_conditions_combine_with_and_and_or() -> None:
    condition = A & (B | C)
    assert isinstance(condition, AssetAll) and isinstance(condition.objects[1], AssetAny)
    assert condition.summary() == "a & (b | c)"
    assert not condition.evaluate({"a"})
    assert condition.evaluate({"a", "c"})
    assert (A & B & C).summary() == "a & b & c"


def test_each_event_of_a_single_asset_makes_one_run_and_and_waits_for_both() -> None:
    assert plan_runs(A, {"a": [3, 1, 2]}, 10) == [[1], [2], [3]]
    assert plan_runs(A, {"a": [1, 2, 3]}, 2) == [[1], [2]]
    assert plan_runs(A & B, {"a": [1, 2]}, 10) == []
    assert plan_runs(A & B, {"a": [1, 2], "b": [5]}, 10) == [[1, 5]]


def test_a_dag_scheduled_on_assets_has_its_condition_as_its_schedule() -> None:
    dag = DAG("on_assets", schedule=[A, B])
    assert dag.asset_condition is not None and dag.timetable.summary == "a & b"
    assert not dag.timetable.can_be_scheduled


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Asset(), "Asset() needs a name or a uri"),
        (lambda: Asset(""), "asset name must be a non-empty string"),
        (lambda: Asset("x" * 1001), "is longer than 1000 characters"),
        (lambda: Asset("bad\nname"), "holds control characters"),
        (lambda: Asset(uri="airflow://x"), "the scheme 'airflow' is reserved"),
        (lambda: Asset(uri="s3://a b"), "holds a space"),
        (lambda: Asset(7), "asset name must be a non-empty string"),  # type: ignore[arg-type]
        (
            lambda: AssetWatcher("w", DateTimeTrigger(dt.datetime.now(dt.UTC))),
            "DateTimeTrigger is not an event trigger",
        ),
        (lambda: Asset("a", watchers=["w"]), "watchers must be AssetWatcher"),  # type: ignore[list-item]
        (lambda: AssetAll(A, "b"), "AssetAll takes assets or conditions, got str"),  # type: ignore[arg-type]
        (lambda: DAG("d", schedule=[Asset(f"a{i}") for i in range(101)]), "at most 100"),
        (lambda: DAG("d", schedule=Asset("a", uri="x") | Asset("a", uri="y")), "two uris"),
        (lambda: RedisStreamTrigger("http://x", "s", "g"), "must be a redis://"),
        (lambda: AssetWatcher("w", _Unsealable()), "AssetWatcher 'w' kwargs['x']"),
        (lambda: DirectoryWatchTrigger("relative"), "must be an absolute path"),
        (lambda: HttpPollTrigger("ftp://x"), "url must be an http://"),
    ],
)
def test_bad_input_is_refused_in_one_line_naming_it(build: Any, message: str) -> None:
    with pytest.raises((AssetError, ValueError)) as refused:
        build()
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_outlets_take_assets_only() -> None:
    with DAG("d"), pytest.raises(AssetError, match=r"task 't': outlets must be Asset, got str"):
        EmptyOperator(task_id="t", outlets=["a"])
    with DAG("d2"):
        task = EmptyOperator(task_id="t", outlets=[A])
    assert task.outlets == [A]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "payload", ["not a dict", {"no": "key"}, {"key": ""}, {"key": "k" * 251}, {"key": 7}]
)
def test_an_event_without_a_bounded_string_key_is_refused(payload: Any) -> None:
    with pytest.raises(ValueError, match="key"):
        event_from_trigger(TriggerEvent(payload))


def test_an_event_keeps_its_extra_beside_its_key() -> None:
    assert event_from_trigger(TriggerEvent({"key": "k", "n": 1})) == ("k", {"n": 1})


def test_an_oversized_stream_entry_is_recorded_as_a_note() -> None:
    trigger = RedisStreamTrigger("redis://x", "s", "g")
    payload = trigger._payload(b"1-0", {b"big": b"x" * 70_000})
    assert payload["key"] == "s:1-0" and "over" in payload["fields"]["error"]


class _Body(BaseHTTPRequestHandler):
    bodies: ClassVar[list[bytes]] = []

    def do_GET(self) -> None:
        body = self.bodies.pop(0) if len(self.bodies) > 1 else self.bodies[0]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


async def _events(trigger: Any, count: int) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    with anyio.fail_after(10):
        async for event in trigger.run():
            got.append(event.payload)
            if len(got) == count:
                break
    return got


def test_the_http_poller_fires_once_per_new_body() -> None:
    _Body.bodies = [b"v1", b"v1", b"v2", b"v2"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Body)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/feed"
        first, second = anyio.run(_events, HttpPollTrigger(url, poll_interval=0.01), 2)
    finally:
        server.shutdown()
    assert first["key"] != second["key"] and first["url"] == url
    assert _Body.bodies == [b"v2"]  # v1 twice made one event


def test_the_directory_watcher_fires_once_per_matching_file(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "c.csv").write_text("c")
    trigger = DirectoryWatchTrigger(str(tmp_path), "*.csv", poll_interval=0.01)
    events = anyio.run(_events, trigger, 2)
    assert [Path(e["path"]).name for e in events] == ["a.csv", "c.csv"]


def test_a_file_delete_trigger_deletes_its_file_only_once_the_event_is_recorded(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "flag"
    trigger = DirectoryFileDeleteTrigger(
        directory=str(tmp_path), filename="flag", poke_interval=0.01
    )
    assert trigger.serialize()[1] == {
        "directory": str(tmp_path),
        "filename": "flag",
        "poke_interval": 0.01,
    }

    async def first_and_ack() -> tuple[dict[str, Any], dict[str, Any]]:
        flag.write_text("1")
        first, again = await _events(trigger, 2)  # not acknowledged: the same file, same key
        await trigger.acknowledge(TriggerEvent(again))
        return first, again

    first, again = anyio.run(first_and_ack)
    assert first == again and first["path"] == str(flag)
    assert not flag.exists()
    flag.write_text("22")  # a new file is a new event
    (second,) = anyio.run(_events, FileDeleteTrigger(str(flag), 0.01), 1)
    assert second["key"] != first["key"]


def test_a_file_rewritten_before_its_event_is_recorded_is_kept(tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    flag.write_text("1")
    trigger = FileDeleteTrigger(str(flag), 0.01)
    (event,) = anyio.run(_events, trigger, 1)
    os.utime(flag, ns=(0, 0))
    anyio.run(trigger.acknowledge, TriggerEvent(event))
    assert flag.exists()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: FileDeleteTrigger("relative"), "filepath must be an absolute path"),
        (lambda: FileDeleteTrigger("/tmp/x", 0), "poke_interval must be greater than 0"),
        (
            lambda: DirectoryFileDeleteTrigger(directory="/tmp", filename="a/b"),
            "filename must be a file name",
        ),
    ],
)
def test_bad_file_delete_triggers_are_refused_naming_the_argument(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_an_assets_access_control_is_checked_and_kept_as_one_teams_airflow() -> None:
    """Airflow 3.3's AssetAccessControl filters events by team only with multi_team on;
    deferral is one team: checked as Airflow checks it, kept, filtering nothing."""
    control = AssetAccessControl(producer_teams=["team_analytics"], allow_global=False)
    shared = Asset("shared", uri="s3://lake/shared.csv", access_control=control)
    assert (shared.access_control, Asset("plain").access_control) == (
        control,
        AssetAccessControl([], None, True),
    )
    for bad, said in [
        ({"producer_teams": [""]}, "each entry in producer_teams must be a non-empty string"),
        ({"consumer_teams": "team"}, "consumer_teams must be a list of team names"),
        ({"allow_global": "no"}, "allow_global must be True or False"),
    ]:
        with pytest.raises(AssetError, match=said):
            AssetAccessControl(**bad)
    with pytest.raises(AssetError, match="access_control must be AssetAccessControl"):
        Asset("x", access_control={"allow_global": False})  # type: ignore[arg-type]
