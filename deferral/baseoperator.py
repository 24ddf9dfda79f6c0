"""``BaseOperator``, the unit of work, with ``chain`` and ``cross_downstream``: the public module
(Airflow's ``airflow.models.baseoperator``). The class is defined in
``deferral.authoring.operator``; importing it from here also imports the mapping
(``deferral.authoring.mappedoperator``) that ``BaseOperator.partial()`` hands on to."""

from __future__ import annotations

from deferral.authoring import mappedoperator as _mapping  # noqa: F401  (sets BaseOperator.partial's)
from deferral.authoring.operator import TASK_SETTINGS, BaseOperator, chain, cross_downstream

__all__ = ["TASK_SETTINGS", "BaseOperator", "chain", "cross_downstream"]
