"""``macros`` in templates, as Airflow's ``airflow.macros``: ``{{ macros.ds_add(ds, 7) }}``,
``{{ macros.datetime.now() }}``, ``{{ macros.timedelta(days=1) }}``, ``macros.time``,
``macros.uuid``, ``macros.random``, ``macros.json``."""

from __future__ import annotations

import json
import random as _random
import time
import uuid
from datetime import datetime, timedelta

random = _random.random

__all__ = ["datetime", "ds_add", "ds_format", "json", "random", "time", "timedelta", "uuid"]


def ds_add(ds: str, days: int) -> str:
    """``ds`` (YYYY-MM-DD) moved by ``days`` (negative to go back): ds_add('2015-01-01', 5) is
    '2015-01-06'."""
    if not days:
        return str(ds)
    moved = datetime.strptime(str(ds), "%Y-%m-%d") + timedelta(days=days)
    return moved.strftime("%Y-%m-%d")


def ds_format(ds: str, input_format: str, output_format: str) -> str:
    """``ds`` read with ``input_format`` and written with ``output_format``:
    ds_format('2015-01-01', '%Y-%m-%d', '%m-%d-%y') is '01-01-15'."""
    return datetime.strptime(str(ds), input_format).strftime(output_format)
