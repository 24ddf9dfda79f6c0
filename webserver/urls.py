"""Where the web UI's pages and API answers are: the URLs templates and redirects build, and
which paths a login or a form may send the browser back to."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from starlette.requests import Request

API = "/api/v1"


def dag_url(dag_id: str, **query: Any) -> str:
    url = f"/dags/{quote(dag_id, safe='')}"
    given = {key: value for key, value in query.items() if value is not None}
    return f"{url}?{urlencode(given)}" if given else url


def _ti_query(run_id: str, task_id: str, map_index: int | None, try_number: int | None) -> str:
    query: dict[str, Any] = {"run_id": run_id, "task_id": task_id}
    if map_index is not None and map_index >= 0:
        query["map_index"] = map_index
    if try_number is not None:
        query["try_number"] = try_number
    return urlencode(query)


def ti_url(
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int | None = None,
    try_number: int | None = None,
) -> str:
    """The page of a task instance (showing the log of ``try_number``)."""
    query = _ti_query(run_id, task_id, map_index, try_number)
    return f"/dags/{quote(dag_id, safe='')}/task_instance?{query}"


def log_url(dag_id: str, run_id: str, task_id: str, map_index: int, try_number: int) -> str:
    """The API answer with the lines of one try's log."""
    query = _ti_query(run_id, task_id, map_index, try_number)
    return f"{API}/dags/{quote(dag_id, safe='')}/task_instance/log?{query}"


def safe_next(target: object, default: str = "/dags") -> str:
    """A same-site path to go back to (never another site: ``//host`` or a scheme)."""
    if isinstance(target, str) and target.startswith("/") and not target.startswith(("//", "/\\")):
        return target
    return default


def here(request: Request) -> str:
    """The path and query of ``request``: where to come back to."""
    query = request.url.query
    return f"{request.url.path}?{query}" if query else request.url.path
