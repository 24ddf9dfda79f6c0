"""Assets are unique by URI as well as by name (Airflow's rule): the first asset recorded with a
URI holds it, another of another name with that URI is inactive, and a task naming an inactive
asset in its inlets or outlets fails before it runs (the example DAGs' test runs that through
`dags test`: tests/integration/test_airflow3_examples.py, read_asset_event)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral import DAG
from deferral.assets import Asset
from deferral.exceptions import FailTask, InactiveAssetInInletOrOutlet
from deferral.operators import EmptyOperator
from deferral.runtime.config import Settings
from deferral.store.assets import inactive_assets, record_assets
from deferral.store.tables import AssetModel
from scheduler.assets import named_assets
from scheduler.service import SchedulerService

HELD = Asset(name="test-asset", uri="s3://output/1.txt")
SAME_URI = Asset("s3://output/1.txt")
OTHER = Asset(name="other", uri="s3://output/2.txt")


def _active(sessions: sessionmaker[Session]) -> dict[str, bool]:
    with sessions() as session:
        rows = session.execute(select(AssetModel.name, AssetModel.active))
        return {name: active for name, active in rows}


def test_the_first_recorded_holds_the_uri_and_keeps_it(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        record_assets(session, [HELD, SAME_URI, OTHER])
    assert _active(sessions) == {"test-asset": True, "s3://output/1.txt": False, "other": True}
    # A later read naming them in the other order does not move the URI: its holder keeps it.
    with sessions.begin() as session:
        record_assets(session, [SAME_URI, HELD])
    assert _active(sessions) == {"test-asset": True, "s3://output/1.txt": False, "other": True}
    with sessions() as session:
        assert inactive_assets(session, [HELD, SAME_URI, OTHER]) == [SAME_URI]
        # One not recorded yet counts as active.
        assert inactive_assets(session, [Asset("s3://never/recorded")]) == []


def test_an_asset_no_dag_names_gives_up_its_uri_on_a_read_of_every_dag(
    sessions: sessionmaker[Session],
) -> None:
    """As Airflow orphans an asset no DAG references: renamed with its URI kept, the asset
    takes the URI from its old name at the next read of every DAG (an interim read, or one with
    an import error, may not have seen every DAG naming the old one: the holder keeps it)."""
    with sessions.begin() as session:
        record_assets(session, [HELD, OTHER], every_named=True)
    with sessions.begin() as session:
        record_assets(session, [SAME_URI, OTHER])
    assert _active(sessions) == {"test-asset": True, "s3://output/1.txt": False, "other": True}
    with sessions.begin() as session:
        record_assets(session, [SAME_URI, OTHER], every_named=True)
    assert _active(sessions) == {"test-asset": False, "s3://output/1.txt": True, "other": True}
    # The old name named again finds its URI held.
    with sessions.begin() as session:
        record_assets(session, [HELD, SAME_URI, OTHER], every_named=True)
    assert _active(sessions) == {"test-asset": False, "s3://output/1.txt": True, "other": True}


RENAMED_DAG = """
from deferral import DAG
from deferral.assets import Asset
from deferral.operators import EmptyOperator

with DAG("renames_its_asset"):
    EmptyOperator(task_id="writes", outlets=[Asset(name="{name}", uri="s3://renamed/1.txt")])
"""


def test_a_scheduler_gives_a_renamed_assets_uri_to_its_new_name_unless_a_file_is_broken(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    service = SchedulerService(settings, name="s")
    write_dag("renames", RENAMED_DAG.format(name="before"))
    service.refresh_dags()
    write_dag("renames", RENAMED_DAG.format(name="after"))
    broken = write_dag("broken", "raise RuntimeError('broken for a moment')\n")
    service.refresh_dags()
    assert _active(sessions) == {"before": True, "after": False}
    broken.unlink()
    service.refresh_dags()
    assert _active(sessions) == {"before": False, "after": True}


def test_a_read_records_inlets_too_in_dag_id_order(sessions: sessionmaker[Session]) -> None:
    """The DAGs' assets are taken in DAG-id order, whatever the order of the files: the
    inlet-only asset of the later DAG id is the inactive one."""
    with DAG("read_asset_event") as reader:
        EmptyOperator(task_id="reads", inlets=[SAME_URI])
    with DAG("asset_with_extra") as writer:
        EmptyOperator(task_id="writes", outlets=[HELD])
    assert named_assets({"read_asset_event": reader, "asset_with_extra": writer}) == [
        HELD,
        SAME_URI,
    ]
    with sessions.begin() as session:
        record_assets(
            session, named_assets({"read_asset_event": reader, "asset_with_extra": writer})
        )
    assert _active(sessions) == {"test-asset": True, "s3://output/1.txt": False}


def test_the_failure_names_the_assets_as_airflow_and_is_not_retried() -> None:
    error = InactiveAssetInInletOrOutlet([("s3://output/1.txt", "s3://output/1.txt")])
    assert isinstance(error, FailTask)
    assert str(error) == (
        "Task has the following inactive assets in its inlets or outlets:"
        " Asset(name='s3://output/1.txt', uri='s3://output/1.txt')"
    )
