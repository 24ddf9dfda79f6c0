"""What a page and its API answer read, from a request's parameters (checked) to the read model's
record: the pages (`pages`) render it, the API (`api`) encodes it. Blocking: called in the
thread pool."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from deferral.runtime.crypto import Cipher
from deferral.states import DagRunState, TaskState
from readmodel import dags, processes, streams, tasks, waits
from readmodel.doctor import doctor_record
from readmodel.pages import DEFAULT_LIMIT, MAX_LIMIT
from readmodel.runs import run_list
from readmodel.triggers import trigger_list
from webserver import data
from webserver.inputs import MAX_INT64, BadInput, check_id, int_param

if TYPE_CHECKING:
    from webserver.app import WebUI

Found = TypeVar("Found")


def required_id(params: Mapping[str, Any], name: str) -> str:
    """The id ``name`` of a query, form or body (checked: no control characters, not too
    long)."""
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise BadInput(f"{name} is required")
    return check_id(name, value)


def _optional_id(params: Mapping[str, Any], name: str) -> str | None:
    value = params.get(name)
    return check_id(name, value) if isinstance(value, str) and value else None


def _page_params(query: Mapping[str, str]) -> dict[str, Any]:
    """``?limit=`` (default DEFAULT_LIMIT) and ``?after=`` (a cursor a previous page gave)."""
    limit = int_param(query.get("limit"), "limit", low=1, high=MAX_LIMIT)
    return {"limit": limit or DEFAULT_LIMIT, "after": query.get("after") or None}


def _state(query: Mapping[str, str], states: type[StrEnum]) -> str | None:
    """``?state=``, one of ``states``' values, or None."""
    state = query.get("state") or None
    if state is not None and state not in {s.value for s in states}:
        raise BadInput(f"state must be one of {', '.join(s.value for s in states)}")
    return state


class Reads:
    def __init__(self, ui: WebUI) -> None:
        self.ui = ui

    def _read(self, read: Callable[..., Found], *args: Any, **kwargs: Any) -> Found:
        with self.ui.sessions() as session:
            return read(session, *args, **kwargs)

    def dags_overview(self, request: Request) -> dict[str, Any]:
        tags = dags.wanted_tags(request.query_params.getlist("tags"))
        search = request.query_params.get("search", "")[: data.MAX_SEARCH_LENGTH]
        return self._read(dags.dags_overview, tags, search)

    def dag_detail(self, request: Request) -> dict[str, Any]:
        query = request.query_params
        runs = int_param(query.get("runs"), "runs", low=1, high=data.MAX_GRID_RUNS)
        return self._read(
            data.dag_page,
            request.path_params["dag_id"],
            runs or data.GRID_RUNS,
            _optional_id(query, "run_id"),
            int_param(query.get("task_page"), "task_page", low=1) or 1,
            [check_id("collapse", group) for group in query.getlist("collapse")],
        )

    def task_instance(self, request: Request) -> dict[str, Any]:
        query = request.query_params
        return self._read(
            tasks.task_instance_detail,
            self.ui.settings,
            request.path_params["dag_id"],
            required_id(query, "run_id"),
            required_id(query, "task_id"),
            int_param(query.get("map_index"), "map_index", low=-1),
            int_param(query.get("try_number"), "try_number", low=1),
        )

    def task_log(self, request: Request) -> dict[str, Any]:
        query = request.query_params
        try_number = int_param(required_id(query, "try_number"), "try_number", low=1)
        return self._read(
            tasks.task_log,
            request.path_params["dag_id"],
            required_id(query, "run_id"),
            required_id(query, "task_id"),
            int_param(query.get("map_index"), "map_index", low=-1) or -1,
            try_number,
            int_param(query.get("after_id"), "after_id", low=0, high=MAX_INT64) or 0,
            int_param(query.get("limit"), "limit", low=1, high=tasks.LOG_LINES_SHOWN)
            or tasks.LOG_LINES_SHOWN,
        )

    def deferred(self, request: Request) -> dict[str, Any]:
        """A page of the deferred tasks: ``?limit=`` of them from just after ``?after=``."""
        query = request.query_params
        limit = int_param(query.get("limit"), "limit", low=1, high=waits.MAX_DEFERRED_PAGE)
        return self._read(
            waits.deferred_now,
            self.ui.settings,
            limit=limit or waits.DEFERRED_PAGE,
            after=query.get("after") or None,
        )

    def runs(self, request: Request) -> dict[str, Any]:
        """A page of runs, newest logical date first (``?dag_id=``, ``?state=``)."""
        query = request.query_params
        page = self._read(
            run_list,
            **_page_params(query),
            dag_id=_optional_id(query, "dag_id"),
            state=_state(query, DagRunState),
        )
        return {"runs": page.rows, "next_after": page.after}

    def task_list(self, request: Request) -> dict[str, Any]:
        """A page of task instances, newest first (``?dag_id=``, ``?state=``)."""
        query = request.query_params
        page = self._read(
            tasks.task_list,
            **_page_params(query),
            dag_id=_optional_id(query, "dag_id"),
            state=_state(query, TaskState),
        )
        return {"task_instances": page.rows, "next_after": page.after}

    def triggers(self, request: Request) -> dict[str, Any]:
        """A page of triggers, oldest first, each with the tasks waiting on it."""
        page = self._read(trigger_list, **_page_params(request.query_params))
        return {"triggers": page.rows, "next_after": page.after}

    def processes(self, request: Request) -> dict[str, Any]:
        return self._read(processes.processes, self.ui.settings)

    def streams(self, request: Request) -> dict[str, Any]:
        return streams.streams_overview(self.ui.broker(), Cipher(self.ui.settings.fernet_keys))

    def doctor(self, request: Request) -> dict[str, object]:
        return doctor_record(self.ui.settings)
