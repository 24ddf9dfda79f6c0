"""The asset rows: each asset the parsed DAGs name, and whether it is active. Assets are unique
by name and by URI (as Airflow's): the first asset recorded with a URI holds it, and another
asset of another name with the same URI stays inactive while the holder is recorded; a task
naming an inactive asset in its inlets or outlets fails before it runs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.assets import Asset
from deferral.store.metastore import metastore
from deferral.store.tables import AssetModel


def record_assets(session: Session, assets: Sequence[Asset], *, every_named: bool = False) -> None:
    """Insert or update the rows of ``assets``, in the order given (first come, first holding
    their URI: callers give them in DAG-id order, so a folder's read decides the same way each
    time); an asset whose URI an active asset of another name holds is recorded inactive.

    ``every_named``: ``assets`` are all that the DAGs name (a read of the whole folder without
    an import error). An active asset that none names any more then holds its URI no longer
    (recorded inactive, as Airflow orphans an asset no DAG references): an asset renamed with
    its URI kept takes the URI at once, instead of being inactive for ever behind its old
    name."""
    if every_named:
        session.execute(
            update(AssetModel)
            .where(AssetModel.active, AssetModel.name.not_in({a.name for a in assets}))
            .values(active=False)
        )
    if not assets:
        return
    held = session.execute(
        select(AssetModel.uri, AssetModel.name).where(
            AssetModel.active, AssetModel.uri.in_({a.uri for a in assets})
        )
    )
    holders = {uri: name for uri, name in held}
    rows = []
    for asset in assets:
        holder = holders.setdefault(asset.uri, asset.name)
        active = holder == asset.name
        rows.append({"name": asset.name, "uri": asset.uri, "group": asset.group, "active": active})
    statement = insert(AssetModel).values(sorted(rows, key=lambda r: r["name"]))
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[AssetModel.name],
            set_={
                "uri": statement.excluded.uri,
                "group": statement.excluded.group,
                "active": statement.excluded.active,
            },
        )
    )


def inactive_assets(session: Session, assets: Iterable[Asset]) -> list[Asset]:
    """Those of ``assets`` recorded inactive (one not recorded yet counts as active: its DAG's
    next read records it)."""
    wanted = {a.name: a for a in assets}
    if not wanted:
        return []
    inactive = set(
        session.scalars(
            select(AssetModel.name).where(AssetModel.name.in_(wanted), ~AssetModel.active)
        )
    )
    return [asset for name, asset in sorted(wanted.items()) if name in inactive]


def inactive_in_store(assets: Iterable[Asset]) -> list[Asset]:
    """``inactive_assets`` on this process's database (a task process's, before its task
    runs)."""
    with metastore().sessions() as session:
        return inactive_assets(session, assets)
