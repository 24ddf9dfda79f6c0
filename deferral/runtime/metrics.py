"""Every Prometheus metric the services expose, defined here and nowhere else.

Each service serves its own registry on ``--metrics-port`` (:func:`serve`): the metrics common to
the consumer core, its own, the streams' lengths and pending counts (read from Redis at scrape
time, through a function the service hands over once it is connected: this package does not
speak to Redis), and the process's CPU and memory. The metrics table of docs/operations.md
lists the same names; a test keeps the two equal.
"""

from __future__ import annotations

import errno
import importlib.metadata
import logging
import platform
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from deferral.runtime.faults import is_transient

log = logging.getLogger("deferral.runtime.metrics")

SCHEDULER, WORKER, TRIGGERER, WEBSERVER = "scheduler", "worker", "triggerer", "webserver"
# The processes that consume streams; the web UI serves metrics of its own beside them.
SERVICES = (SCHEDULER, WORKER, TRIGGERER)
PROCESSES = (*SERVICES, WEBSERVER)

# From a millisecond to the heartbeat's scale: the targets are single-digit milliseconds, the
# trouble is seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# -- every process ------------------------------------------------------------------------------

BUILD_INFO = Gauge(
    "deferral_build_info",
    "Always 1; the labels say which deferral and Python this process runs.",
    ["version", "python"],
    registry=None,
)

# -- the consumer core (every service) ----------------------------------------------------------

LOOP_ITERATION = Gauge(
    "deferral_loop_iteration_timestamp_seconds",
    "Unix time of this service's latest main-loop iteration: a value that stops moving while"
    " the process answers means its loop is stuck.",
    registry=None,
)

SERVERS_AVAILABLE = Gauge(
    "deferral_servers_available",
    "1 while this process reaches PostgreSQL and Redis, 0 during an outage (from its first"
    " transient error until its loops have reached them for a few seconds): its readiness.",
    registry=None,
)
SERVERS_AVAILABLE.set(1)

CLOCK_SKEW = Gauge(
    "deferral_clock_skew_seconds",
    "How far this host's clock is ahead of PostgreSQL's (negative: behind), measured at every"
    " heartbeat; time triggers fire by PostgreSQL's clock.",
    registry=None,
)

REDIS_UNAVAILABLE = Gauge(
    "deferral_redis_unavailable",
    "1 while this process's calls to Redis fail for a server reason (unreachable, loading, a"
    " read-only replica, maxmemory reached with noeviction), until none failed for 10 s; else 0.",
    registry=None,
)
REDIS_ERRORS = Counter(
    "deferral_redis_errors",
    "Calls to Redis this process retried because the server failed, by error (ConnectionError,"
    " TimeoutError, BusyLoadingError, ReadOnlyError, TryAgainError, OutOfMemoryError).",
    ["error"],
    registry=None,
)
LEASE_RENEWALS = Counter(
    "deferral_lease_renewals",
    "Stream entries whose lease this process renewed (owner-checked, every heartbeat).",
    ["stream"],
    registry=None,
)
LEASE_TAKEOVERS = Counter(
    "deferral_lease_takeovers",
    "Stream entries this process took over from a consumer that stopped renewing them.",
    ["stream"],
    registry=None,
)
DEAD_LETTERS = Counter(
    "deferral_dead_letters",
    "Stream entries this process moved to the dead-letter stream (bad, forged or poison).",
    ["stream"],
    registry=None,
)
FORGED_COUNTS = Counter(
    "deferral_delivery_counts_ignored",
    "Delivery counts Redis gave for stream entries that PostgreSQL does not back (the consumer"
    " named is not registered, or did not die holding the entry), set aside.",
    ["stream"],
    registry=None,
)

# -- triggerer ----------------------------------------------------------------------------------

TRIGGERS_RUNNING = Gauge(
    "deferral_triggers_running", "Triggers this triggerer runs now.", registry=None
)
TRIGGERER_CAPACITY_LEFT = Gauge(
    "deferral_triggerer_capacity_left",
    "Triggers this triggerer may still take (its capacity minus those running).",
    registry=None,
)
TRIGGERS_FIRED = Counter(
    "deferral_triggers_fired", "Trigger events published (the task resumes).", registry=None
)
TRIGGERS_FAILED = Counter(
    "deferral_triggers_failed",
    "Trigger failures published (the trigger raised, ended without an event, or its event"
    " could not be carried; the task resumes at its failure).",
    registry=None,
)
TRIGGERS_CANCELLED = Counter(
    "deferral_triggers_cancelled",
    "Triggers stopped before firing, by reason: shutdown, reassigned, timeout, user_action,"
    " superseded.",
    ["reason"],
    registry=None,
)
LOOP_LAG = Histogram(
    "deferral_triggerer_loop_lag_seconds",
    "How late the triggerer's event loop ran a 50 ms timer: the delay every trigger saw.",
    buckets=LATENCY_BUCKETS,
    registry=None,
)
LOOP_STALLS = Counter(
    "deferral_triggerer_loop_stalls",
    "Times the event loop stalled past DEFERRAL_TRIGGERER_STALL_THRESHOLD_SEC (each logged with"
    " the trigger holding it and its stack).",
    registry=None,
)

# The name this counter had before the stall monitor; kept for one release so that dashboards
# and alerts on it keep working (it counts exactly what LOOP_STALLS counts).
BLOCKED_LOOP_WARNINGS = Counter(
    "deferral_triggerer_blocked_loop_warnings",
    "Deprecated alias of deferral_triggerer_loop_stalls_total, kept for one release.",
    registry=None,
)
ASSET_WATCHER_BOUND_REACHED = Counter(
    "deferral_asset_watcher_bound_reached",
    "Times an asset watcher stopped reading its source because DEFERRAL_ASSET_WATCHER_MAX_QUEUED"
    " of its events waited for their runs (each logged once; it reads on as runs start).",
    registry=None,
)

# -- scheduler ----------------------------------------------------------------------------------

EVENTS = Counter(
    "deferral_events",
    "Trigger events read by this scheduler, by outcome: applied (resumed a task), duplicate"
    " (its dedup key was applied before), stale (its task no longer waits on that trigger),"
    " ended (a task-end event ended its task, end_from_trigger).",
    ["outcome"],
    registry=None,
)
TRIGGER_PROGRESS = Counter(
    "deferral_trigger_progress",
    "Progress reports of triggers (TriggerProgress) recorded, one per waiting task; a report"
    " whose task no longer waits records nothing.",
    registry=None,
)
RESUME_LATENCY = Histogram(
    "deferral_resume_latency_seconds",
    "From an event's publication (its stream entry id, Redis's clock) to the commit that made"
    " its task SCHEDULED.",
    buckets=LATENCY_BUCKETS,
    registry=None,
)
DISPATCHES = Counter(
    "deferral_dispatches",
    "Task instances this scheduler queued (scheduled -> queued, committed).",
    registry=None,
)
TRIGGER_TIMEOUTS = Counter(
    "deferral_trigger_timeouts",
    "Deferred tasks whose trigger timeout passed, resumed at their failure.",
    registry=None,
)
# The name it had before (a stutter); kept for one release, counting exactly the same.
DEFERRAL_TIMEOUTS = Counter(
    "deferral_deferral_timeouts",
    "Deprecated alias of deferral_trigger_timeouts_total, kept for one release.",
    registry=None,
)
DEADLINE_MISSES = Counter(
    "deferral_deadline_misses",
    "DAG runs that had not finished by a DeadlineAlert's deadline (each counted once, by the"
    " scheduler replica that recorded it).",
    registry=None,
)
HITL_TIMEOUTS = Counter(
    "deferral_hitl_timeouts",
    "Tasks awaiting input whose response timeout passed (resumed with their default options,"
    " or failed without any).",
    registry=None,
)
DAG_IMPORT_ERRORS = Gauge(
    "deferral_dag_import_errors",
    "DAG files this scheduler's latest parse of the DAGs folder could not load.",
    registry=None,
)
RECONCILER_REPAIRS = Counter(
    "deferral_reconciler_repairs",
    "Repairs by the reconciler, by kind: triggers and queue (entries Postgres needs that no"
    " stream held, republished), orphaned_attempt (running on a dead worker, entry gone: failed"
    " into a retry).",
    ["kind"],
    registry=None,
)

# -- worker -------------------------------------------------------------------------------------

TASK_ATTEMPTS = Counter(
    "deferral_task_attempts",
    "Task attempts this worker ended, by outcome: success, failed, deferred, rescheduled,"
    " skipped, awaiting_input, or dropped (the attempt's lease was taken over: its outcome did"
    " not count).",
    ["outcome"],
    registry=None,
)
ATTEMPTS_RUNNING = Gauge(
    "deferral_worker_attempts_running", "Task attempts this worker runs now.", registry=None
)
WORKER_SLOTS_FREE = Gauge(
    "deferral_worker_slots_free",
    "Attempts this worker may still start (its concurrency minus those running).",
    registry=None,
)

# -- webserver ----------------------------------------------------------------------------------

WEB_REQUESTS = Counter(
    "deferral_webserver_requests",
    "HTTP requests answered, by method, route (the path pattern, not the path) and status.",
    ["method", "route", "status"],
    registry=None,
)
WEB_REQUEST_SECONDS = Histogram(
    "deferral_webserver_request_seconds",
    "Time to answer an HTTP request, by route (the path pattern).",
    ["route"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)

_EVERY: tuple[MetricWrapperBase, ...] = (BUILD_INFO,)
_COMMON: tuple[MetricWrapperBase, ...] = (
    LEASE_RENEWALS,
    LEASE_TAKEOVERS,
    DEAD_LETTERS,
    FORGED_COUNTS,
    LOOP_ITERATION,
    SERVERS_AVAILABLE,
    CLOCK_SKEW,
    REDIS_UNAVAILABLE,
    REDIS_ERRORS,
)
_OWN: dict[str, tuple[MetricWrapperBase, ...]] = {
    TRIGGERER: (
        TRIGGERS_RUNNING,
        TRIGGERER_CAPACITY_LEFT,
        TRIGGERS_FIRED,
        TRIGGERS_FAILED,
        TRIGGERS_CANCELLED,
        LOOP_LAG,
        LOOP_STALLS,
        BLOCKED_LOOP_WARNINGS,
        ASSET_WATCHER_BOUND_REACHED,
    ),
    SCHEDULER: (
        EVENTS,
        TRIGGER_PROGRESS,
        RESUME_LATENCY,
        DISPATCHES,
        TRIGGER_TIMEOUTS,
        DEFERRAL_TIMEOUTS,
        HITL_TIMEOUTS,
        DEADLINE_MISSES,
        RECONCILER_REPAIRS,
        DAG_IMPORT_ERRORS,
    ),
    WORKER: (TASK_ATTEMPTS, ATTEMPTS_RUNNING, WORKER_SLOTS_FREE),
    WEBSERVER: (WEB_REQUESTS, WEB_REQUEST_SECONDS),
}

# Every value a labelled counter of a service can take, shown (at 0) from the first scrape: an
# alert on a rise must see the first event too. Label values are snake_case, never spaces.
CANCEL_REASONS = ("shutdown", "reassigned", "timeout", "user_action", "superseded")
EVENT_OUTCOMES = ("applied", "duplicate", "stale")
REPAIR_KINDS = ("triggers", "queue", "orphaned_attempt")
ATTEMPT_OUTCOMES = ("success", "failed", "deferred", "rescheduled", "skipped", "dropped")
KNOWN_LABELS: dict[MetricWrapperBase, tuple[str, ...]] = {
    TRIGGERS_CANCELLED: CANCEL_REASONS,
    EVENTS: EVENT_OUTCOMES,
    RECONCILER_REPAIRS: REPAIR_KINDS,
    TASK_ATTEMPTS: ATTEMPT_OUTCOMES,
}
# The counters of the consumer core, labelled by the stream a consumer reads.
STREAM_COUNTERS = (LEASE_RENEWALS, LEASE_TAKEOVERS, DEAD_LETTERS, FORGED_COUNTS)


def show_stream(stream: str) -> None:
    """Show the consumer core's counters for ``stream`` (at 0) before anything happens on it."""
    for counter in STREAM_COUNTERS:
        counter.labels(stream)


# -- streams (read at scrape time) --------------------------------------------------------------

STREAM_LENGTH = "deferral_stream_length"
STREAM_PENDING = "deferral_stream_pending"
STREAM_LAG = "deferral_stream_lag"
STREAM_METRICS = {
    STREAM_LENGTH: "Entries in each stream under the prefix (triggers, events, queues, dead).",
    STREAM_PENDING: "Entries delivered to a consumer group and not yet retired, per stream and"
    " group (held by a consumer, or waiting to be taken over).",
    STREAM_LAG: "Entries not yet delivered to a consumer group, per stream and group.",
}


Source = TypeVar("Source")


class GroupStats(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def pending(self) -> int: ...
    @property
    def lag(self) -> int | None: ...


class StreamStats(Protocol):
    @property
    def stream(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def groups(self) -> Sequence[GroupStats]: ...


class FailureAccount(Protocol):
    def failed(self, exc: BaseException, doing: str = "") -> None: ...


class ReadWhenScraped(Collector, Generic[Source]):
    """Gauges computed when scraped from what the function a service gives :meth:`watch`
    returns (nothing before: the service is not connected yet; nothing while it raises: a
    scrape must answer even while Redis or PostgreSQL does not)."""

    what = "the source"
    # Where a server failing under a scrape is reported: the process's outage account sets
    # itself here (deferral.runtime.outages), so that an outage scraped every few seconds is
    # said once a minute, not once a scrape. None: logged each time.
    outage: FailureAccount | None = None

    def __init__(self) -> None:
        self._read: Callable[[], Source] | None = None

    def watch(self, read: Callable[[], Source]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        if self._read is None:
            return
        try:
            source = self._read()
        except Exception as exc:
            self._failed(exc)
            return
        yield from self.families(source)

    def _failed(self, exc: Exception) -> None:
        if self.outage is not None and is_transient(exc):
            self.outage.failed(exc, f"reading {self.what} for /metrics")
        else:
            log.warning("could not read %s for /metrics: %s", self.what, exc)

    def families(self, source: Source) -> Iterator[Metric]:
        raise NotImplementedError


class StreamsCollector(ReadWhenScraped[Sequence[StreamStats]]):
    """The streams' lengths, pending counts and lag (from Redis)."""

    what = "the streams"

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(name, text) for name, text in STREAM_METRICS.items()]

    def families(self, source: Sequence[StreamStats]) -> Iterator[Metric]:
        length, pending, lag = (
            GaugeMetricFamily(name, STREAM_METRICS[name], labels=SCRAPE_TIME_LABELS[name])
            for name in (STREAM_LENGTH, STREAM_PENDING, STREAM_LAG)
        )
        for stats in source:
            length.add_metric([stats.stream], stats.length)
            for group in stats.groups:
                pending.add_metric([stats.stream, group.name], group.pending)
                if group.lag is not None:
                    lag.add_metric([stats.stream, group.name], group.lag)
        yield from (length, pending, lag)


STREAMS = StreamsCollector()

DEFERRED_TASKS = "deferral_deferred_tasks"
DEFERRED_HELP = "Deferred tasks, by the class of the trigger they wait on."
# The labels of the gauges computed at scrape time (the wrapped metrics know their own).
SCRAPE_TIME_LABELS: dict[str, tuple[str, ...]] = {
    STREAM_LENGTH: ("stream",),
    STREAM_PENDING: ("stream", "group"),
    STREAM_LAG: ("stream", "group"),
    DEFERRED_TASKS: ("trigger_class",),
}


class DeferredCollector(ReadWhenScraped[Mapping[str, int]]):
    """Deferred tasks by the class of the trigger they wait on (the scheduler's query)."""

    what = "the deferred tasks"

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(DEFERRED_TASKS, DEFERRED_HELP)]

    def families(self, source: Mapping[str, int]) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            DEFERRED_TASKS, DEFERRED_HELP, labels=SCRAPE_TIME_LABELS[DEFERRED_TASKS]
        )
        for classpath, count in sorted(source.items()):
            family.add_metric([classpath], count)
        yield family


DEFERRED = DeferredCollector()


def _collectors(process: str) -> tuple[MetricWrapperBase | Collector, ...]:
    if process == WEBSERVER:
        return (*_EVERY, *_OWN[WEBSERVER])
    # Stream lengths and the deferred tasks are the same whoever reads them: the schedulers
    # (every one, the same values: `max by`) export them, not every process.
    global_gauges = (STREAMS, DEFERRED) if process == SCHEDULER else ()
    return (*_EVERY, *_COMMON, *_OWN[process], *global_gauges)


def registry_for(process: str) -> CollectorRegistry:
    """What ``process`` serves: build info, the core's metrics, its own (each known label value
    at 0), the global gauges if it is a scheduler, and its process's CPU and memory."""
    BUILD_INFO.labels(_version(), platform.python_version()).set(1)
    for metric, values in KNOWN_LABELS.items():
        if metric in _OWN[process]:
            for value in values:
                metric.labels(value)
    registry = CollectorRegistry(auto_describe=True)
    for collector in _collectors(process):
        registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


def _version() -> str:
    try:
        return importlib.metadata.version("deferral")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Definition:
    """One deferral metric as a scrape shows it (counters with their ``_total``)."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str


def definitions(process: str) -> list[Definition]:
    """Every deferral metric a scrape of ``process`` can show, the standard ``process_*``
    metrics aside: what docs/operations.md's table and the docs' reference list."""
    found: list[Definition] = []
    for collector in _collectors(process):
        labels = getattr(collector, "_labelnames", None)  # a wrapped metric's own labels
        for family in collector.describe():  # type: ignore[union-attr]  # each one describes
            name = f"{family.name}_total" if family.type == "counter" else family.name
            own = tuple(labels) if labels is not None else SCRAPE_TIME_LABELS[family.name]
            found.append(Definition(name, family.type, own, family.documentation))
    return found


def served_names(process: str) -> set[str]:
    """Every deferral metric name a scrape of ``process`` can show."""
    return {definition.name for definition in definitions(process)}


class MetricsServerError(Exception):
    """The metrics port cannot be bound; the message says why in one line."""


def serve(service: str, port: int, host: str = "127.0.0.1") -> threading.Thread:
    """Serve ``service``'s metrics on ``host``:``port`` at ``/metrics``, from a daemon thread;
    MetricsServerError if the address cannot be bound."""
    disable_created_metrics()  # a *_created series per counter only doubles a scrape's size
    try:
        _, thread = start_http_server(port, addr=host, registry=registry_for(service))
    except socket.gaierror as exc:
        raise MetricsServerError(f"--metrics-host {host}: {exc.strerror or exc}") from None
    except OSError as exc:
        # Naming the host when it is the one at fault (not on this machine).
        fault = (
            f"--metrics-host {host}"
            if exc.errno == errno.EADDRNOTAVAIL
            else f"--metrics-port {port}"
        )
        raise MetricsServerError(f"{fault}: {exc.strerror or exc}") from None
    log.info("%s metrics on http://%s:%d/metrics", service, host, port)
    return thread
