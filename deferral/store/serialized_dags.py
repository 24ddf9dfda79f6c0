"""The parsed DAGs the web UI and the CLI read, as Airflow's serialized DAG table: a pure
serializer (a DAG object -> a typed, JSON-able document), the writer the schedulers call after
each parse (only the DAGs whose document changed), and the readers.

Whoever reads a document never imports the DAG file it came from: a file that hangs or does
harm at import costs the scheduler's parse child an import error, never a page or a command."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import hashlib
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, exists, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.authoring.markers import StoredMarker, marker_of
from deferral.exceptions import ActionError, DagDefinitionError
from deferral.runtime.secrets_masker import redact
from deferral.store.tables import DagFolderParse, SerializedDag
from deferral.timetables import DagRunInfo, DataInterval, TimeRestriction, Timetable, next_info
from deferral.timetables.serialized import deserialize_timetable

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator
    from deferral.dag import DAG

log = logging.getLogger("deferral.store.serialized_dags")

# The documentation attributes of a task, as Airflow names them.
TASK_DOCS = ("doc_md", "doc", "doc_rst", "doc_json", "doc_yaml")
# The version of the documents serialize_dag writes: 2 keeps the timetable and the
# ExternalTaskMarkers' targets, which a trigger, a clear and a mark read.
DOCUMENT_VERSION = 2


@dataclass(frozen=True)
class StoredParam:
    """A param of the trigger form: its default as shown anywhere (a secret-looking one masked,
    as the form masks it), its JSON schema, whether it has a default, its description."""

    name: str
    value: Any
    schema: dict[str, Any] = field(default_factory=dict)
    has_value: bool = True
    description: str = ""


@dataclass(frozen=True)
class StoredMapping:
    """A mapped task before it expands: over what (as its repr), the tasks it waits for, and
    how many instances a literal gives (None: known only once they finished)."""

    expand_input: str
    dependencies: list[str]
    literal_length: int | None


@dataclass(frozen=True)
class StoredTask:
    task_id: str
    # The operator's class name, as the DAG file wrote it.
    operator: str
    upstream: list[str]
    downstream: list[str]
    # Its task groups, outermost first (none: not in a group).
    groups: list[str]
    trigger_rule: str
    template_fields: list[str]
    is_mapped: bool
    is_setup: bool
    is_teardown: bool
    retries: int
    retry_delay_sec: float
    pool: str
    queue: str
    owner: str
    depends_on_past: bool
    wait_for_downstream: bool
    display_name: str | None = None
    # Its documentation attributes (TASK_DOCS) that are set, by name.
    docs: dict[str, str] = field(default_factory=dict)
    mapping: StoredMapping | None = None
    marker: StoredMarker | None = None

    @property
    def retry_delay(self) -> dt.timedelta:
        return dt.timedelta(seconds=self.retry_delay_sec)

    @functools.cached_property
    def upstream_task_ids(self) -> set[str]:
        return set(self.upstream)

    @functools.cached_property
    def downstream_task_ids(self) -> set[str]:
        return set(self.downstream)


@dataclass(frozen=True)
class StoredDag:
    """A DAG as the last parse found it: what every page and display command shows of it."""

    dag_id: str
    fileloc: str
    display_name: str | None
    description: str | None
    # The timetable's summary (a cron expression, "@daily", "None", ...).
    schedule: str | None
    tags: list[str]
    owners: list[str]
    owner_links: dict[str, str]
    params: list[StoredParam]
    doc_md: str | None
    max_active_tasks: int
    max_active_runs: int
    catchup: bool
    is_paused_upon_creation: bool
    # Its tasks upstream first (by id when they form a cycle).
    tasks: list[StoredTask]
    # (upstream, downstream, label) of each labelled edge.
    edge_labels: list[tuple[str, str, str]] = field(default_factory=list)
    # Its timetable as its serialize() gives it (None: a DAG file's own, which only its
    # file makes again).
    timetable: dict[str, Any] | None = None
    # Its start_date and end_date (ISO 8601; None: not set).
    start_date: str | None = None
    end_date: str | None = None
    # DOCUMENT_VERSION when written (a document without one: 1).
    version: int = 1

    @functools.cached_property
    def task_dict(self) -> dict[str, StoredTask]:
        return {task.task_id: task for task in self.tasks}

    def downstream_of(self, task_id: str) -> set[str]:
        """Every task reachable downstream of ``task_id``."""
        tasks = self.task_dict
        found: set[str] = set()
        pending = [task_id]
        while pending:
            for down in tasks[pending.pop()].downstream_task_ids - found:
                found.add(down)
                pending.append(down)
        return found

    def marker_of(self, task_id: str) -> StoredMarker | None:
        return self.task_dict[task_id].marker

    def rebuilt_timetable(self) -> Timetable | None:
        """Its timetable made again from the document (None: a DAG file's own)."""
        return deserialize_timetable(self.timetable) if self.timetable is not None else None

    def _timetable(self) -> Timetable:
        timetable = self.rebuilt_timetable()
        if timetable is None:
            raise ValueError(f"DAG {self.dag_id!r} has a timetable of its DAG file's own")
        return timetable

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        """The data interval of a run triggered at ``run_after``, from the kept timetable;
        ValueError for a DAG file's own timetable (only its file can say)."""
        return self._timetable().infer_manual_data_interval(run_after=run_after)

    def next_dagrun_info(
        self, last_automated_data_interval: DataInterval | None, *, now: dt.datetime
    ) -> DagRunInfo | None:
        """``DAG.next_dagrun_info`` from the kept timetable, start and end dates and catchup;
        ValueError for a DAG file's own timetable."""
        restriction = TimeRestriction(
            dt.datetime.fromisoformat(self.start_date) if self.start_date else None,
            dt.datetime.fromisoformat(self.end_date) if self.end_date else None,
            self.catchup,
        )
        return next_info(
            self._timetable(),
            last_automated_data_interval=last_automated_data_interval,
            restriction=restriction,
            now=now,
        )

    @property
    def order(self) -> list[str]:
        return [task.task_id for task in self.tasks]

    def document(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_document(cls, data: Mapping[str, Any]) -> StoredDag:
        tasks = [
            StoredTask(
                **{
                    **task,
                    "mapping": StoredMapping(**task["mapping"]) if task.get("mapping") else None,
                    "marker": StoredMarker(**task["marker"]) if task.get("marker") else None,
                }
            )
            for task in data["tasks"]
        ]
        return cls(
            **{
                **data,
                "params": [StoredParam(**param) for param in data["params"]],
                "tasks": tasks,
                "edge_labels": [tuple(edge) for edge in data.get("edge_labels", [])],
            }
        )


# -- the serializer: a DAG object -> its document (pure) -----------------------------------------


def serialize_dag(dag: DAG) -> StoredDag:
    """What the web UI and the CLI show of ``dag``, read once from its objects."""
    return StoredDag(
        dag_id=dag.dag_id,
        fileloc=str(dag.fileloc),
        display_name=str(dag.dag_display_name) if dag.dag_display_name != dag.dag_id else None,
        description=dag.description,
        schedule=dag.timetable.summary,
        tags=[str(tag) for tag in dag.tags],
        owners=sorted({str(getattr(t, "owner", "")) for t in dag.tasks} - {""}),
        owner_links=dict(dag.owner_links),
        params=stored_params(dag.params, dag.param_specs),
        doc_md=dag.doc_md_text(),
        max_active_tasks=dag.max_active_tasks,
        max_active_runs=dag.max_active_runs,
        catchup=bool(dag.catchup),
        is_paused_upon_creation=bool(dag.is_paused_upon_creation),
        tasks=[_task(dag.task_dict[task_id]) for task_id in _order(dag)],
        edge_labels=sorted(
            (up, down, str(info["label"]))
            for (up, down), info in dag.edge_info.items()
            if info.get("label")
        ),
        timetable=dag.timetable.serialize(),
        start_date=dag.start_date.isoformat() if dag.start_date else None,
        end_date=dag.end_date.isoformat() if dag.end_date else None,
        version=DOCUMENT_VERSION,
    )


def stored_params(values: Mapping[str, Any], specs: Mapping[str, Any]) -> list[StoredParam]:
    """Each param (a DAG's or a task's values, with their ``Param`` specs) in its order, its
    default masked where the trigger form masks it."""
    shown = redact(dict(values))
    made = []
    for name in values:
        spec = specs.get(name)
        made.append(
            StoredParam(
                name=name,
                value=_json_ready(shown[name]),
                schema=_json_ready(dict(spec.schema)) if spec is not None else {},
                has_value=bool(spec.has_value) if spec is not None else True,
                description=(spec.description or "") if spec is not None else "",
            )
        )
    return made


def _json_ready(value: Any) -> Any:
    """``value`` as JSON keeps it (what JSON cannot hold, as its text)."""
    return json.loads(json.dumps(value, default=str))


def _order(dag: DAG) -> list[str]:
    try:
        return [task.task_id for task in dag.topological_order()]
    except DagDefinitionError:
        return sorted(dag.task_dict)


def _task(task: BaseOperator) -> StoredTask:
    from deferral.authoring.mappedoperator import MappedOperator

    groups: list[str] = []
    group = task.task_group
    while group is not None:
        if group.group_id:
            groups.insert(0, group.group_id)
        group = group.parent_group
    mapping = None
    if isinstance(task, MappedOperator):
        literal: int | None = None
        dependencies = sorted(task.mapped_dependencies())
        if not dependencies:
            literal = task.expand_input.literal_length()
        mapping = StoredMapping(repr(task.expand_input), dependencies, literal)
    name = getattr(task, "task_display_name", None)
    delay = getattr(task, "retry_delay", None)
    return StoredTask(
        task_id=task.task_id,
        operator=type(task).__name__,
        upstream=sorted(task.upstream_task_ids),
        downstream=sorted(task.downstream_task_ids),
        groups=groups,
        trigger_rule=str(task.trigger_rule),
        template_fields=_names(getattr(task, "template_fields", ())),
        is_mapped=bool(task.is_mapped),
        is_setup=bool(task.is_setup),
        is_teardown=bool(task.is_teardown),
        retries=int(getattr(task, "retries", 0) or 0),
        retry_delay_sec=delay.total_seconds() if isinstance(delay, dt.timedelta) else 0.0,
        pool=str(getattr(task, "pool", "") or ""),
        queue=str(getattr(task, "queue", "") or ""),
        owner=str(getattr(task, "owner", "") or ""),
        depends_on_past=bool(getattr(task, "depends_on_past", False)),
        wait_for_downstream=bool(getattr(task, "wait_for_downstream", False)),
        display_name=str(name) if name else None,
        docs={doc: str(text) for doc in TASK_DOCS if (text := getattr(task, doc, None))},
        mapping=mapping,
        marker=marker_of(task),
    )


def _names(fields: Any) -> list[str]:
    """An operator's ``template_fields``: a sequence of names, or one name as Airflow allows."""
    return [fields] if isinstance(fields, str) else [str(name) for name in fields]


# Each DAG's last document and hash, with the DAG object it was made from: a parse that finds
# a file unchanged hands over the same objects, which are not serialized again.
_documents: dict[str, tuple[DAG, dict[str, Any], str]] = {}


def _document(dag: DAG) -> tuple[dict[str, Any], str]:
    made = _documents.get(dag.dag_id)
    if made is None or made[0] is not dag:
        document = serialize_dag(dag).document()
        made = (dag, document, dag_hash(document))
        _documents[dag.dag_id] = made
    return made[1], made[2]


def dag_hash(document: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


# -- the writer: what the schedulers call after each parse ---------------------------------------


def write(
    session: Session,
    folder: str,
    dags: Mapping[str, DAG],
    pending: Collection[str] = (),
) -> list[str]:
    """Record the DAGs a parse of ``folder`` found: a DAG whose document changed is written, an
    unchanged one is left alone, and a DAG no longer loaded is removed (but for those of the
    files ``pending``, which an interim read has not read yet); a DAG that fails to serialize
    keeps its last document (logged). Returns the ids written."""
    stored = dict(session.execute(select(SerializedDag.dag_id, SerializedDag.dag_hash)).all())
    rows = []
    for dag_id, dag in sorted(dags.items()):  # one lock order for every replica
        try:
            document, digest = _document(dag)
        except Exception:
            # One DAG whose objects will not serialize keeps its last document; the parse is
            # recorded for every other DAG.
            log.exception("DAG %s could not be serialized for the web UI and the CLI", dag_id)
            continue
        if stored.get(dag_id) != digest:
            row = {"dag_id": dag_id, "fileloc": str(dag.fileloc), "data": document}
            rows.append({**row, "dag_hash": digest})
    for gone in set(_documents) - set(dags):
        del _documents[gone]
    written: list[str] = []
    if rows:
        statement = insert(SerializedDag).values(rows)
        written = list(
            session.scalars(
                statement.on_conflict_do_update(
                    index_elements=[SerializedDag.dag_id],
                    set_={
                        "fileloc": statement.excluded.fileloc,
                        "data": statement.excluded.data,
                        "dag_hash": statement.excluded.dag_hash,
                        "updated_at": func.now(),
                    },
                    where=SerializedDag.dag_hash != statement.excluded.dag_hash,
                ).returning(SerializedDag.dag_id)
            )
        )
    session.execute(
        delete(SerializedDag).where(
            SerializedDag.dag_id.not_in(sorted(dags)), SerializedDag.fileloc.not_in(list(pending))
        )
    )
    parsed = insert(DagFolderParse).values(folder=folder)
    session.execute(
        parsed.on_conflict_do_update(
            index_elements=[DagFolderParse.folder], set_={"parsed_at": func.now()}
        )
    )
    return written


# -- the readers ---------------------------------------------------------------------------------

# What the web UI and the CLI say where no scheduler has recorded a parse yet.
NOT_PARSED = "no DAGs parsed yet: is a scheduler running?"


def parsed_yet(session: Session) -> bool:
    """Whether a scheduler has recorded a parse of a DAGs folder."""
    return bool(session.scalar(select(exists().select_from(DagFolderParse))))


def read_dag(session: Session, dag_id: str) -> StoredDag | None:
    data = session.scalar(select(SerializedDag.data).where(SerializedDag.dag_id == dag_id))
    return StoredDag.from_document(data) if data is not None else None


def read_dag_to_change(session: Session, dag_id: str) -> StoredDag | None:
    """``read_dag`` for a trigger, a clear or a mark: ActionError for a document an older
    scheduler wrote (without the timetable and the markers these read; a scheduler of this
    version rewrites it at its first parse)."""
    dag = read_dag(session, dag_id)
    if dag is not None and dag.version < DOCUMENT_VERSION:
        raise ActionError(
            f"DAG {dag_id!r} was last parsed by an older scheduler: try again once a scheduler "
            "of this version has parsed the DAGs folder"
        )
    return dag


def read_dags(session: Session, dag_ids: Sequence[str] | None = None) -> dict[str, StoredDag]:
    """The stored DAGs by id (those of ``dag_ids`` if given)."""
    query = select(SerializedDag.data)
    if dag_ids is not None:
        query = query.where(SerializedDag.dag_id.in_(list(dag_ids)))
    found = (StoredDag.from_document(data) for data in session.scalars(query))
    return {dag.dag_id: dag for dag in found}


@dataclass(frozen=True)
class DagSummary:
    """What the DAG lists show of a stored DAG (read without its tasks)."""

    dag_id: str
    fileloc: str
    display_name: str | None
    schedule: str | None
    tags: list[str]
    is_paused_upon_creation: bool
    task_count: int


def read_summaries(session: Session) -> dict[str, DagSummary]:
    """Every stored DAG's summary by id: its document's small fields only, however many tasks
    it has."""
    data = SerializedDag.data
    rows = session.execute(
        select(
            SerializedDag.dag_id,
            SerializedDag.fileloc,
            data["display_name"].astext,
            data["schedule"].astext,
            data["tags"],
            data["is_paused_upon_creation"].as_boolean(),
            func.jsonb_array_length(data["tasks"]),
        )
    )
    return {row[0]: DagSummary(*row) for row in rows}
