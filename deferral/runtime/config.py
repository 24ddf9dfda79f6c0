"""Settings read from ``DEFERRAL_*`` environment variables (and ``deferral.toml`` if present).

Every setting is validated when the settings are loaded, so that a process with a missing or
malformed setting stops at start with one line naming it, instead of failing later mid-work.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import os
import re
import tomllib
import zoneinfo
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from cryptography.fernet import Fernet

from deferral.runtime import redis_urls
from deferral.runtime.secrets_masker import mask_secret

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

ENV_PREFIX = "DEFERRAL_"
TOML_FILE = "deferral.toml"

T = TypeVar("T")

# A flood on a watched stream waits in the stream, not as thousands of queued runs.
DEFAULT_ASSET_WATCHER_MAX_QUEUED = 500


class ConfigError(Exception):
    """A setting is missing or malformed; the message names it."""


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str
    fernet_keys: tuple[str, ...]
    dags_folder: Path
    stream_prefix: str
    # Logical shards of the triggers and events streams (fixed once chosen: broker/DECISIONS.md).
    stream_shards: int
    heartbeat_sec: float
    triggerer_capacity: int
    trigger_modules: tuple[str, ...]
    default_deferrable: bool
    default_timezone: zoneinfo.ZoneInfo
    # Deliveries of one stream entry that did not survive a heartbeat before it is dead-lettered.
    max_deliveries: int
    # About how many entries deferral:dead keeps (older ones are trimmed).
    dead_letter_maxlen: int
    # How long a running run's DAG may fail to import before its unfinished tasks are failed.
    dag_import_grace_sec: float
    # How often the scheduler reads the DAGs folder again (changed and new files).
    dag_refresh_sec: float
    # Age after which the scheduler prunes finished history (None: never).
    prune_older_than: dt.timedelta | None
    # Syntax of .deferralignore files: "regexp" or "glob" (Airflow's core.dag_ignore_file_syntax).
    dag_ignore_file_syntax: str
    # Most task instances one mapped task may expand into (Airflow's core.max_map_length).
    max_map_length: int
    # Most bytes a try's log keeps of what its task and the triggerer wrote
    # (deferral.store.tasklogs).
    task_log_max_bytes: int
    # How long the triggerer's event loop may not move before the stall is reported.
    triggerer_stall_threshold_sec: float = 0.2
    # Attempts a worker's task process runs before a fresh one replaces it (worker/DECISIONS.md).
    worker_task_process_max_attempts: int = 10_000
    # How long a worker stopped with SIGTERM lets its running attempts finish before it hands
    # the rest back, untried (worker/DECISIONS.md); compose's stop_grace_period exceeds it.
    worker_stop_grace_sec: float = 270.0
    # Seconds one DAG file may take to import before it is an import error (Airflow's
    # core.dagbag_import_timeout; 0: no limit).
    dagbag_import_timeout: float = 30.0
    # New triggers entries one triggerer reads per loop at most (replicas share a backlog).
    triggerer_claim_per_loop: int = 50
    # Events of one asset watcher that may wait for their runs before it stops reading its source.
    asset_watcher_max_queued: int = DEFAULT_ASSET_WATCHER_MAX_QUEUED
    # A time trigger due further ahead than this when its task defers waits as a row, its entry
    # published only once its moment comes this near (deferral.store.far_timers).
    far_timer_horizon_sec: float = 600.0
    # Resumed tasks are dispatched ahead of new work of equal priority weight.
    resumed_first: bool = True


def _parsed_url(raw: str) -> URL | None:
    """``raw`` as SQLAlchemy reads a database URL; None if it is not one."""
    # Imported when settings are read: a command that reads none (`--version`, `--help`)
    # starts without SQLAlchemy.
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(raw)
    except ArgumentError:
        return None


def _database_url(raw: str) -> str:
    url = _parsed_url(raw)
    if url is None:
        raise ValueError("not a database URL")
    if url.get_backend_name() != "postgresql":
        raise ValueError(f"expected a postgresql URL, got {url.get_backend_name()!r}")
    if url.drivername != "postgresql+psycopg":
        # psycopg 3 is the one driver we depend on; normalise the common spellings to it.
        url = url.set(drivername="postgresql+psycopg")
    return url.render_as_string(hide_password=False)


def _redis_url(raw: str) -> str:
    if not raw.startswith(redis_urls.URL_STARTS):
        raise ValueError("expected " + ", ".join(redis_urls.URL_STARTS))
    redis_urls.parse(raw)  # a cluster or sentinel URL's hosts and service
    return raw


def _fernet_keys(raw: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if not keys:
        raise ValueError("no key given")
    for position, key in enumerate(keys, start=1):
        try:
            Fernet(key)
        except ValueError as exc:
            raise ValueError(f"key {position} is not a valid Fernet key") from exc
    return keys


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be greater than 0")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _stream_shards(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= redis_urls.MAX_STREAM_SHARDS:
        raise ValueError(f"must be 1..{redis_urls.MAX_STREAM_SHARDS}")
    return value


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected true or false")


def _stream_prefix(raw: str) -> str:
    prefix = raw.strip().rstrip(":")
    if not prefix or any(ch.isspace() for ch in prefix):
        raise ValueError("must be a non-empty word without spaces")
    return prefix


def _module_prefixes(raw: str) -> tuple[str, ...]:
    prefixes = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not prefixes:
        raise ValueError("no module prefix given")
    return prefixes


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(raw: str) -> dt.timedelta:
    """``7d``, ``12h``, ``1d12h``, ``30m``, ``45s`` or a plain number of seconds."""
    text = raw.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"{raw!r} is not a duration such as 7d, 12h, 30m or 45s") from None
        seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    if seconds < 0:
        raise ValueError("must not be negative")
    return dt.timedelta(seconds=seconds)


def _retention(raw: str) -> dt.timedelta | None:
    if raw.strip().lower() in {"off", "never", "0"}:
        return None
    return parse_duration(raw)


def _timezone(raw: str) -> zoneinfo.ZoneInfo:
    try:
        return zoneinfo.ZoneInfo(raw.strip())
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {raw!r} (use an IANA name such as UTC)") from None


IGNORE_SYNTAXES = ("regexp", "glob")

DEFAULT_MAX_MAP_LENGTH = 1024
DEFAULT_TASK_LOG_MAX_BYTES = 1024 * 1024


def _ignore_syntax(raw: str) -> str:
    syntax = raw.strip().lower()
    if syntax not in IGNORE_SYNTAXES:
        raise ValueError(f"expected regexp or glob, got {raw!r}")
    return syntax


def _read_toml(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    table = data.get("deferral", data)
    return {f"{ENV_PREFIX}{key.upper()}": _toml_text(value) for key, value in table.items()}


def _toml_text(value: object) -> str:
    """A TOML value as its environment-variable spelling (arrays become comma-separated)."""
    if isinstance(value, list):
        return ",".join(_toml_text(item) for item in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# Settings that may instead be read from a file named by ``<setting>_FILE`` (Docker secrets):
# every secret, so that none has to sit in an environment that `docker inspect` shows.
SECRET_SETTINGS = (
    "DATABASE_URL",
    "DATABASE_PASSWORD",
    "REDIS_URL",
    "FERNET_KEY",
    "WEBSERVER_ADMIN_PASSWORD",
    "SMTP_PASSWORD",
)
FILE_SUFFIX = "_FILE"


def secret(source: Mapping[str, str], key: str) -> str | None:
    """The value of ``key`` (a full ``DEFERRAL_...`` name), or the contents of the file that
    ``key_FILE`` names (its trailing newline dropped); None if neither is set. ConfigError if
    both are, or if the file cannot be read."""
    value, path = source.get(key) or None, source.get(key + FILE_SUFFIX) or None
    if path is None:
        return value
    if value is not None:
        raise ConfigError(f"{key} and {key}{FILE_SUFFIX} are both set: set one")
    try:
        return Path(path).read_text().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"{key}{FILE_SUFFIX}: cannot read {path}: {exc.strerror}") from None


def _sources(environ: Mapping[str, str] | None, toml_path: Path | None) -> dict[str, str]:
    """The settings file's values overridden by the environment's, secrets read from their
    files, and ``DEFERRAL_DATABASE_PASSWORD`` put into the database URL."""
    source = _read_toml(toml_path if toml_path is not None else Path(TOML_FILE))
    source.update(os.environ if environ is None else environ)
    for name in SECRET_SETTINGS:
        key = ENV_PREFIX + name
        value = secret(source, key)
        source.pop(key + FILE_SUFFIX, None)
        if value is not None:
            source[key] = value
    password = source.pop(ENV_PREFIX + "DATABASE_PASSWORD", None)
    url = source.get(ENV_PREFIX + "DATABASE_URL")
    parsed = _parsed_url(url) if password and url else None
    if parsed is not None:  # a URL that is none is named by its own check
        with_password = parsed.set(password=password)
        source[ENV_PREFIX + "DATABASE_URL"] = with_password.render_as_string(hide_password=False)
    return source


def _setting(
    source: Mapping[str, str], name: str, parse: Callable[[str], T], default: str | None = None
) -> T:
    key = ENV_PREFIX + name
    raw = source.get(key, default)
    if raw is None or raw == "":
        raise ConfigError(f"{key} is not set")
    try:
        return parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{key} is malformed: {exc}") from None


def load_settings(
    environ: Mapping[str, str] | None = None, toml_path: Path | None = None
) -> Settings:
    """Read and validate every setting; raise ConfigError naming the first bad one."""
    source = _sources(environ, toml_path)

    def get(name: str, parse: Callable[[str], T], default: str | None = None) -> T:
        return _setting(source, name, parse, default)

    database_url = get("DATABASE_URL", _database_url)
    redis_url = get("REDIS_URL", _redis_url)
    return Settings(
        database_url=database_url,
        redis_url=redis_url,
        fernet_keys=get("FERNET_KEY", _fernet_keys),
        dags_folder=get("DAGS_FOLDER", Path, default="dags"),
        stream_prefix=get("STREAM_PREFIX", _stream_prefix, default="deferral"),
        stream_shards=get(
            "STREAM_SHARDS",
            _stream_shards,
            default=str(redis_urls.default_stream_shards(redis_url)),
        ),
        heartbeat_sec=get("HEARTBEAT_SEC", _positive_float, default="5"),
        triggerer_capacity=get("TRIGGERER_CAPACITY", _positive_int, default="1000"),
        trigger_modules=get("TRIGGER_MODULES", _module_prefixes, default="deferral.triggers"),
        default_deferrable=get("DEFAULT_DEFERRABLE", _bool, default="false"),
        default_timezone=get("DEFAULT_TIMEZONE", _timezone, default="UTC"),
        max_deliveries=get("MAX_DELIVERIES", _positive_int, default="5"),
        dead_letter_maxlen=get("DEAD_LETTER_MAXLEN", _positive_int, default="100000"),
        dag_import_grace_sec=get("DAG_IMPORT_GRACE_SEC", _non_negative_float, default="300"),
        dag_refresh_sec=get("DAG_REFRESH_SEC", _positive_float, default="10"),
        dagbag_import_timeout=get("DAGBAG_IMPORT_TIMEOUT", _non_negative_float, default="30"),
        prune_older_than=get("PRUNE_OLDER_THAN", _retention, default="7d"),
        dag_ignore_file_syntax=get("DAG_IGNORE_FILE_SYNTAX", _ignore_syntax, default="regexp"),
        max_map_length=get("MAX_MAP_LENGTH", _positive_int, default=str(DEFAULT_MAX_MAP_LENGTH)),
        task_log_max_bytes=get(
            "TASK_LOG_MAX_BYTES", _positive_int, default=str(DEFAULT_TASK_LOG_MAX_BYTES)
        ),
        triggerer_stall_threshold_sec=get(
            "TRIGGERER_STALL_THRESHOLD_SEC", _positive_float, default="0.2"
        ),
        worker_task_process_max_attempts=get(
            "WORKER_TASK_PROCESS_MAX_ATTEMPTS", _positive_int, default="10000"
        ),
        worker_stop_grace_sec=get("WORKER_STOP_GRACE_SEC", _non_negative_float, default="270"),
        triggerer_claim_per_loop=get("TRIGGERER_CLAIM_PER_LOOP", _positive_int, default="50"),
        asset_watcher_max_queued=get(
            "ASSET_WATCHER_MAX_QUEUED",
            _positive_int,
            default=str(DEFAULT_ASSET_WATCHER_MAX_QUEUED),
        ),
        far_timer_horizon_sec=get("FAR_TIMER_HORIZON_SEC", _positive_float, default="600"),
        resumed_first=get("RESUMED_FIRST", _bool, default="true"),
    )


def is_configured(
    name: str, environ: Mapping[str, str] | None = None, toml_path: Path | None = None
) -> bool:
    """Whether ``DEFERRAL_<name>`` is given, in the environment or the settings file."""
    return bool(_sources(environ, toml_path).get(ENV_PREFIX + name))


def metastore_settings(
    environ: Mapping[str, str] | None = None, toml_path: Path | None = None
) -> tuple[str, tuple[str, ...]]:
    """``DEFERRAL_DATABASE_URL`` and ``DEFERRAL_FERNET_KEY`` alone: all that Variables and
    Connections need, in a task's process or in any script (no Redis setting required)."""
    source = _sources(environ, toml_path)
    return (
        _setting(source, "DATABASE_URL", _database_url),
        _setting(source, "FERNET_KEY", _fernet_keys),
    )


def _one_setting(name: str, parse: Callable[[str], T], default: str) -> T:
    """One setting read on its own from the environment: DAG files are parsed by processes (and
    tests) that need no other setting."""
    key = ENV_PREFIX + name
    raw = os.environ.get(key) or default
    try:
        return parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{key} is malformed: {exc}") from None


SESSION_POOLING, TRANSACTION_POOLING = "session", "transaction"


def _pooling(raw: str) -> str:
    if raw not in (SESSION_POOLING, TRANSACTION_POOLING):
        raise ValueError(f"expected {SESSION_POOLING} or {TRANSACTION_POOLING}, not {raw!r}")
    return raw


def database_pooling() -> str:
    """``DEFERRAL_DATABASE_POOLING``: ``transaction`` when a PgBouncer in transaction pooling
    mode stands before PostgreSQL (no state kept in a server session), else ``session``."""
    return _one_setting("DATABASE_POOLING", _pooling, SESSION_POOLING)


def default_deferrable() -> bool:
    """``DEFERRAL_DEFAULT_DEFERRABLE``: the default of sensors' ``deferrable``."""
    return _one_setting("DEFAULT_DEFERRABLE", _bool, "false")


def airflow_imports(folder_setting: bool = False) -> bool:
    """``DEFERRAL_AIRFLOW_IMPORTS``: whether DAG files may import from ``airflow``
    (``deferral.loading.airflow_imports``); when it is not set, what the DAGs folder's own settings
    file says (``folder_setting``, see ``deferral.loading.dagbag.FOLDER_SETTINGS_FILE``)."""
    return _one_setting("AIRFLOW_IMPORTS", _bool, "true" if folder_setting else "false")


def _classpath(raw: str) -> str:
    path = raw.strip()
    module, _, name = path.rpartition(".")
    if not module or not name.isidentifier():
        raise ValueError(f"{path!r} is not a module.Class path")
    return path


def xcom_backend() -> str | None:
    """``DEFERRAL_XCOM_BACKEND``: the ``module.Class`` (a ``BaseXCom`` subclass) that turns XCom
    values into what is stored and back; unset: values are stored as they are."""
    given = os.environ.get(ENV_PREFIX + "XCOM_BACKEND", "").strip()
    return _one_setting("XCOM_BACKEND", _classpath, "") if given else None


def callback_base_url() -> str:
    """``DEFERRAL_CALLBACK_BASE_URL``: the web server's address as callers reach it, the start
    of the URL ``context["callback"].url`` gives a task."""
    return _one_setting("CALLBACK_BASE_URL", _base_url, "http://localhost:8080")


def idempotency_window() -> dt.timedelta:
    """``DEFERRAL_IDEMPOTENCY_WINDOW_SEC``: how long an idempotency key of a signal, a callback
    answer or a triggered run is remembered (a repeat within it returns the first answer)."""
    return dt.timedelta(seconds=_one_setting("IDEMPOTENCY_WINDOW_SEC", _positive_float, "86400"))


def _base_url(raw: str) -> str:
    url = raw.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
        raise ValueError(f"{url!r} is not an http(s) URL")
    return url


def default_timezone() -> zoneinfo.ZoneInfo:
    """``DEFERRAL_DEFAULT_TIMEZONE``: the zone naive datetimes in DAG files are read in."""
    return _one_setting("DEFAULT_TIMEZONE", _timezone, "UTC")


def dag_ignore_file_syntax() -> str:
    """``DEFERRAL_DAG_IGNORE_FILE_SYNTAX``: how ``.deferralignore`` lines read, regexp or glob."""
    return _one_setting("DAG_IGNORE_FILE_SYNTAX", _ignore_syntax, "regexp")


def max_map_length() -> int:
    """``DEFERRAL_MAX_MAP_LENGTH``: the most task instances one mapped task may expand into."""
    return _one_setting("MAX_MAP_LENGTH", _positive_int, str(DEFAULT_MAX_MAP_LENGTH))


def venv_cache_path() -> str | None:
    """``DEFERRAL_VENV_CACHE_PATH``: where PythonVirtualenvOperator keeps the virtualenvs it
    makes, for tasks without their own ``venv_cache_path`` (unset: made for each attempt)."""
    return os.environ.get(f"{ENV_PREFIX}VENV_CACHE_PATH", "").strip() or None


def _port(raw: str) -> int:
    value = int(raw)
    if not 0 < value < 65536:
        raise ValueError(f"{value} is not a TCP port (1-65535)")
    return value


def webserver_host() -> str:
    """``DEFERRAL_WEBSERVER_HOST``: the address ``deferral webserver`` listens on."""
    return _one_setting("WEBSERVER_HOST", str.strip, "127.0.0.1")


def webserver_port() -> int:
    """``DEFERRAL_WEBSERVER_PORT``: the port ``deferral webserver`` listens on (and that
    ``deferral health --service webserver`` asks)."""
    return _one_setting("WEBSERVER_PORT", _port, "8080")


@dataclass(frozen=True)
class WebserverSettings:
    """What ``deferral webserver`` adds to the shared settings (read on its own, like the host
    and port, so that no other process needs them)."""

    # How long a login lasts, counted from the login (a cookie cannot be kept alive for ever).
    session_lifetime: dt.timedelta
    # The session cookie is sent over HTTPS only (set it when TLS is in front of the UI).
    secure_cookies: bool
    # Host names (with or without port) a server on a non-loopback address answers to, besides
    # the loopback names and its own address; empty: any.
    allowed_hosts: tuple[str, ...]
    # Rate limits (the `limits` library's notation, "50/second;1000/minute") of each user's API
    # signal sends (and each callback token's answers), and of each user's triggered runs.
    signal_rate: str = "50/second;1000/minute"
    run_rate: str = "10/second;120/minute"
    # Signals one web user's sends keep stored at most (a send beyond drops that user's oldest).
    signals_kept_per_user: int = 1000


def _session_lifetime(raw: str) -> dt.timedelta:
    lifetime = parse_duration(raw)
    if lifetime.total_seconds() < 60:
        raise ValueError("must be at least 60 seconds")
    return lifetime


def _rates(raw: str) -> str:
    from limits import parse_many

    try:
        parse_many(raw)
    except ValueError:
        raise ValueError(
            f"{raw!r} is not a rate limit such as 50/second or 10/second;600/minute"
        ) from None
    return raw.strip()


def _host_names(raw: str) -> tuple[str, ...]:
    return tuple(name.strip().lower() for name in raw.split(",") if name.strip())


def webserver_settings(environ: Mapping[str, str] | None = None) -> WebserverSettings:
    """``DEFERRAL_WEBSERVER_SESSION_LIFETIME``, ``DEFERRAL_WEBSERVER_SECURE_COOKIES`` and
    ``DEFERRAL_WEBSERVER_ALLOWED_HOSTS``; ConfigError naming a malformed one."""
    source = os.environ if environ is None else environ

    def get(name: str, parse: Callable[[str], T], default: str) -> T:
        return _setting({k: v for k, v in source.items() if v}, name, parse, default)

    return WebserverSettings(
        session_lifetime=get("WEBSERVER_SESSION_LIFETIME", _session_lifetime, "12h"),
        secure_cookies=get("WEBSERVER_SECURE_COOKIES", _bool, "false"),
        allowed_hosts=get("WEBSERVER_ALLOWED_HOSTS", _host_names, ","),
        signal_rate=get("WEBSERVER_SIGNAL_RATE", _rates, WebserverSettings.signal_rate),
        run_rate=get("WEBSERVER_RUN_RATE", _rates, WebserverSettings.run_rate),
        signals_kept_per_user=get(
            "WEBSERVER_SIGNALS_KEPT_PER_USER",
            _positive_int,
            str(WebserverSettings.signals_kept_per_user),
        ),
    )


@dataclass(frozen=True)
class SmtpSettings:
    """Where email alerts (``email_on_failure`` / ``email_on_retry``) and ``send_email`` go: the
    ``DEFERRAL_SMTP_*`` settings, Airflow's ``[smtp]`` section."""

    host: str
    port: int
    mail_from: str
    starttls: bool
    ssl: bool
    timeout_sec: float
    user: str | None = None
    # Never shown: left out of the repr, and registered with the secrets masker when read.
    password: str | None = field(default=None, repr=False)


def smtp_settings(
    environ: Mapping[str, str] | None = None, toml_path: Path | None = None
) -> SmtpSettings | None:
    """``DEFERRAL_SMTP_HOST``, ``_PORT``, ``_USER``, ``_PASSWORD`` (or ``_PASSWORD_FILE``),
    ``_STARTTLS``, ``_SSL``, ``_MAIL_FROM`` and ``_TIMEOUT_SEC``; None when no host is set (no
    mail is sent). A ConfigError names a malformed one."""
    source = {k: v for k, v in _sources(environ, toml_path).items() if v}
    if not source.get(f"{ENV_PREFIX}SMTP_HOST", "").strip():
        return None

    def get(name: str, parse: Callable[[str], T], default: str | None = None) -> T:
        return _setting(source, name, parse, default)

    user = source.get(f"{ENV_PREFIX}SMTP_USER")
    password = source.get(f"{ENV_PREFIX}SMTP_PASSWORD")
    if (user is None) != (password is None):
        given, missing = ("USER", "PASSWORD") if password is None else ("PASSWORD", "USER")
        raise ConfigError(f"{ENV_PREFIX}SMTP_{given} is set without {ENV_PREFIX}SMTP_{missing}")
    settings = SmtpSettings(
        host=get("SMTP_HOST", str.strip),
        port=get("SMTP_PORT", _port, "25"),
        mail_from=get("SMTP_MAIL_FROM", _mail_address),
        starttls=get("SMTP_STARTTLS", _bool, "true"),
        ssl=get("SMTP_SSL", _bool, "false"),
        timeout_sec=get("SMTP_TIMEOUT_SEC", _positive_float, "30"),
        user=user,
        password=password,
    )
    if settings.ssl and settings.starttls:
        raise ConfigError(
            f"{ENV_PREFIX}SMTP_SSL and {ENV_PREFIX}SMTP_STARTTLS are both true: SSL connects"
            " encrypted from the start (port 465), STARTTLS upgrades a plain connection; set one"
        )
    if password is not None:
        mask_secret(password)
    return settings


def _mail_address(raw: str) -> str:
    """``ops@example.com`` or ``Deferral <ops@example.com>``."""
    text = raw.strip()
    _, address = email.utils.parseaddr(text)
    if "@" not in address or any(ord(ch) < 32 for ch in text):
        raise ValueError(f"{raw!r} is not an email address")
    return text


@dataclass(frozen=True)
class SettingDoc:
    """One ``DEFERRAL_*`` setting as the reference documents it (docs/hooks/reference.py)."""

    name: str  # without the DEFERRAL_ prefix
    default: str | None  # None: required, or unset means "off"
    help: str
    section: str


# Every setting, for the reference (a test fails when code reads a DEFERRAL_* name missing
# here). The parsers above stay the authority on values; this table only describes them.
SETTINGS: tuple[SettingDoc, ...] = (
    SettingDoc("DATABASE_URL", None, "PostgreSQL URL, the system of record (required).", "core"),
    SettingDoc(
        "DATABASE_PASSWORD",
        None,
        "Password put into DATABASE_URL (keeps it out of the URL).",
        "core",
    ),
    SettingDoc(
        "DATABASE_POOLING",
        SESSION_POOLING,
        "`transaction` when a PgBouncer in transaction pooling mode sits before PostgreSQL.",
        "core",
    ),
    SettingDoc(
        "REDIS_URL",
        None,
        "Redis URL whose streams carry the work (required): redis://, rediss:// or unix:// for "
        "one Redis, redis+cluster://host:port[,host:port...] for a Redis Cluster, "
        "redis+sentinel://host:port[,host:port...]/service_name for Sentinel.",
        "core",
    ),
    SettingDoc(
        "FERNET_KEY",
        None,
        "Fernet key(s), comma-separated, newest first: encrypt and sign what is stored (required).",
        "core",
    ),
    SettingDoc("DAGS_FOLDER", "dags", "Folder the DAG files are read from.", "core"),
    SettingDoc(
        "STREAM_PREFIX", "deferral", "Prefix of every Redis key this deployment uses.", "core"
    ),
    SettingDoc(
        "STREAM_SHARDS",
        "1",
        "Logical shards the triggers and events streams are split into, a trigger's chosen "
        "from its id; on a Redis Cluster the shards spread over the primaries, and the default "
        f"there is {redis_urls.CLUSTER_STREAM_SHARDS}. Fixed once chosen: "
        "`deferral reshard-streams` changes it (docs/operations.md).",
        "core",
    ),
    SettingDoc(
        "HEARTBEAT_SEC",
        "5",
        "Lease heartbeat in seconds: a silent consumer's work is taken over after about three.",
        "core",
    ),
    SettingDoc("TRIGGERER_CAPACITY", "1000", "Most triggers one triggerer runs at once.", "core"),
    SettingDoc(
        "TRIGGER_MODULES",
        "deferral.triggers",
        "Comma-separated module prefixes trigger classes may be imported from.",
        "core",
    ),
    SettingDoc("DEFAULT_DEFERRABLE", "false", "Default of sensors' `deferrable`.", "core"),
    SettingDoc("DEFAULT_TIMEZONE", "UTC", "Zone naive datetimes in DAG files are read in.", "core"),
    SettingDoc(
        "MAX_DELIVERIES",
        "5",
        "Deliveries of one stream entry that did not survive a heartbeat before it is"
        " dead-lettered.",
        "core",
    ),
    SettingDoc("DEAD_LETTER_MAXLEN", "100000", "About how many dead letters are kept.", "core"),
    SettingDoc(
        "DAG_IMPORT_GRACE_SEC",
        "300",
        "How long a running run's DAG may fail to import before its unfinished tasks fail.",
        "core",
    ),
    SettingDoc(
        "DAG_REFRESH_SEC",
        "10",
        "How often the scheduler reads the DAGs folder again for changed, new and removed"
        " files (a run of a DAG it has not seen yet makes it look at once).",
        "core",
    ),
    SettingDoc(
        "DAGBAG_IMPORT_TIMEOUT",
        "30",
        "Seconds one DAG file may take to import before it is an import error naming the"
        " file and this timeout (the scheduler, the web UI and the CLI go on meanwhile);"
        " 0: no limit.",
        "core",
    ),
    SettingDoc(
        "CALLBACK_BASE_URL",
        "http://localhost:8080",
        "The web server's address as callers reach it: the start of a task's callback URL.",
        "core",
    ),
    SettingDoc(
        "IDEMPOTENCY_WINDOW_SEC",
        "86400",
        "How long an idempotency key (`--idempotency-key`, the `Idempotency-Key` header) of a"
        " signal, a callback answer or a triggered run is remembered: a repeat within it returns"
        " the first answer and does nothing more.",
        "core",
    ),
    SettingDoc(
        "PRUNE_OLDER_THAN",
        "7d",
        "Age after which the scheduler prunes finished history (`never` to keep it).",
        "core",
    ),
    SettingDoc(
        "DAG_IGNORE_FILE_SYNTAX",
        "regexp",
        "How `.deferralignore` lines read: regexp or glob.",
        "core",
    ),
    SettingDoc(
        "MAX_MAP_LENGTH",
        str(DEFAULT_MAX_MAP_LENGTH),
        "Most task instances one mapped task may expand into.",
        "core",
    ),
    SettingDoc(
        "TASK_LOG_MAX_BYTES",
        str(DEFAULT_TASK_LOG_MAX_BYTES),
        "Most bytes a try's log keeps.",
        "core",
    ),
    SettingDoc(
        "WORKER_TASK_PROCESS_MAX_ATTEMPTS",
        "10000",
        "Attempts one of a worker's task processes runs before a fresh one replaces it.",
        "core",
    ),
    SettingDoc(
        "WORKER_STOP_GRACE_SEC",
        "270",
        "Seconds a worker stopped with SIGTERM lets its running attempts finish before it hands"
        " the rest back to run again at the same try.",
        "core",
    ),
    SettingDoc(
        "TRIGGERER_STALL_THRESHOLD_SEC",
        "0.2",
        "How long the triggerer's event loop may not move before the stall is reported.",
        "core",
    ),
    SettingDoc(
        "TRIGGERER_CLAIM_PER_LOOP",
        "50",
        "New triggers one triggerer takes per loop at most, so replicas share a backlog.",
        "core",
    ),
    SettingDoc(
        "ASSET_WATCHER_MAX_QUEUED",
        str(DEFAULT_ASSET_WATCHER_MAX_QUEUED),
        "Events of one asset watcher that may wait for their runs (queued for a DAG, or in a run"
        " not started yet): at the bound the watcher stops reading its source, logs it once and"
        " counts `deferral_asset_watcher_bound_reached_total`, and reads on as runs start.",
        "core",
    ),
    SettingDoc(
        "FAR_TIMER_HORIZON_SEC",
        "600",
        "A time trigger (`DateTimeTrigger`, `TimeDeltaTrigger`) due further ahead than this when"
        " its task defers waits as a row in PostgreSQL: no triggerer holds it and Redis keeps"
        " nothing for it until the scheduler publishes it, once its moment is this near. Keep it"
        " equal on every scheduler and worker.",
        "core",
    ),
    SettingDoc(
        "RESUMED_FIRST",
        "true",
        "Dispatch resumed tasks (an event or an answer resumed them) ahead of new work of equal"
        " `priority_weight`; `false`: weight, then age.",
        "core",
    ),
    SettingDoc(
        "AIRFLOW_IMPORTS", "false", "Whether DAG files may import from `airflow`.", "dag files"
    ),
    SettingDoc(
        "XCOM_BACKEND", None, "`module.Class` (a BaseXCom subclass) that stores XComs.", "dag files"
    ),
    SettingDoc(
        "VENV_CACHE_PATH",
        None,
        "Where PythonVirtualenvOperator caches the virtualenvs it makes (none: no cache).",
        "dag files",
    ),
    SettingDoc("WEBSERVER_HOST", "127.0.0.1", "Address `deferral webserver` listens on.", "web UI"),
    SettingDoc("WEBSERVER_PORT", "8080", "Port `deferral webserver` listens on.", "web UI"),
    SettingDoc("WEBSERVER_SESSION_LIFETIME", "12h", "How long a web UI login lasts.", "web UI"),
    SettingDoc(
        "WEBSERVER_SECURE_COOKIES",
        "false",
        "Mark the session cookie `Secure` (set it when TLS is in front of the web UI).",
        "web UI",
    ),
    SettingDoc(
        "WEBSERVER_ALLOWED_HOSTS",
        None,
        "Comma-separated host names the web UI answers (none: any).",
        "web UI",
    ),
    SettingDoc(
        "WEBSERVER_SIGNAL_RATE",
        WebserverSettings.signal_rate,
        "Most signals one web user sends through the API (and answers one callback token"
        " takes), as `N/second`, `N/minute`... separated by `;`: past it, 429 with Retry-After.",
        "web UI",
    ),
    SettingDoc(
        "WEBSERVER_RUN_RATE",
        WebserverSettings.run_rate,
        "Most runs one web user triggers (API and trigger form), in the same notation: past it,"
        " 429 with Retry-After.",
        "web UI",
    ),
    SettingDoc(
        "WEBSERVER_SIGNALS_KEPT_PER_USER",
        str(WebserverSettings.signals_kept_per_user),
        "Signals one web user's sends keep stored at most: a send beyond drops that user's oldest.",
        "web UI",
    ),
    SettingDoc(
        "WEBSERVER_ADMIN_PASSWORD",
        None,
        "Password of an `admin` web UI login read from the environment (never stored).",
        "web UI",
    ),
    SettingDoc("METRICS_PORT", None, "Default of the services' `--metrics-port`.", "metrics"),
    SettingDoc(
        "METRICS_HOST", "127.0.0.1", "Default of the services' `--metrics-host`.", "metrics"
    ),
    SettingDoc("SMTP_HOST", None, "SMTP server for email alerts (none: no email).", "email"),
    SettingDoc("SMTP_PORT", "25", "SMTP server port.", "email"),
    SettingDoc("SMTP_USER", None, "SMTP login (with SMTP_PASSWORD).", "email"),
    SettingDoc("SMTP_PASSWORD", None, "SMTP password (with SMTP_USER).", "email"),
    SettingDoc("SMTP_MAIL_FROM", None, "Sender address of email alerts.", "email"),
    SettingDoc("SMTP_STARTTLS", "true", "Upgrade the SMTP connection with STARTTLS.", "email"),
    SettingDoc("SMTP_SSL", "false", "Connect to the SMTP server over TLS.", "email"),
    SettingDoc("SMTP_TIMEOUT_SEC", "30", "SMTP connection timeout in seconds.", "email"),
)
