"""Airflow's ``airflow.timetables.base``: what a DAG file's own timetable subclasses and
returns (``Timetable``, ``DagRunInfo``, ``DataInterval``, ``TimeRestriction``)."""

from deferral.timetables import DagRunInfo, DataInterval, TimeRestriction, Timetable

__all__ = ["DagRunInfo", "DataInterval", "TimeRestriction", "Timetable"]
