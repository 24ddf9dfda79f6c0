"""Date helpers under Airflow's path ``airflow.utils.dates`` (only ``days_ago``; Airflow's other
helpers there are not provided, so importing one fails by name)."""

from __future__ import annotations

import datetime as dt


def days_ago(
    n: int, hour: int = 0, minute: int = 0, second: int = 0, microsecond: int = 0
) -> dt.datetime:
    """Today's UTC midnight (or the time given) ``n`` days back, as Airflow's ``days_ago``
    (deprecated there: prefer a fixed start date, which a DAG file then reads the same every
    time it is parsed)."""
    today = dt.datetime.now(dt.UTC).replace(
        hour=hour, minute=minute, second=second, microsecond=microsecond
    )
    return today - dt.timedelta(days=n)
