"""Settings read from ``DEFERRAL_*`` environment variables (and ``deferral.toml`` if present).

Every setting is validated when the settings are loaded, so that a process with a missing or
malformed setting stops at start with one line naming it, instead of failing later mid-work.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cryptography.fernet import Fernet
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

ENV_PREFIX = "DEFERRAL_"
TOML_FILE = "deferral.toml"

T = TypeVar("T")


class ConfigError(Exception):
    """A setting is missing or malformed; the message names it."""


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str
    fernet_keys: tuple[str, ...]
    dags_folder: Path
    stream_prefix: str
    heartbeat_sec: float
    triggerer_capacity: int
    trigger_modules: tuple[str, ...]
    default_deferrable: bool


def _database_url(raw: str) -> str:
    try:
        url = make_url(raw)
    except ArgumentError as exc:
        raise ValueError("not a database URL") from exc
    if url.get_backend_name() != "postgresql":
        raise ValueError(f"expected a postgresql URL, got {url.get_backend_name()!r}")
    if url.drivername != "postgresql+psycopg":
        # psycopg 3 is the one driver we depend on; normalise the common spellings to it.
        url = url.set(drivername="postgresql+psycopg")
    return url.render_as_string(hide_password=False)


def _redis_url(raw: str) -> str:
    if not raw.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("expected redis://, rediss:// or unix://")
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


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be at least 1")
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


def load_settings(
    environ: Mapping[str, str] | None = None, toml_path: Path | None = None
) -> Settings:
    """Read and validate every setting; raise ConfigError naming the first bad one."""
    source = _read_toml(toml_path if toml_path is not None else Path(TOML_FILE))
    source.update(os.environ if environ is None else environ)

    def get(name: str, parse: Callable[[str], T], default: str | None = None) -> T:
        key = ENV_PREFIX + name
        raw = source.get(key, default)
        if raw is None or raw == "":
            raise ConfigError(f"{key} is not set")
        try:
            return parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{key} is malformed: {exc}") from None

    return Settings(
        database_url=get("DATABASE_URL", _database_url),
        redis_url=get("REDIS_URL", _redis_url),
        fernet_keys=get("FERNET_KEY", _fernet_keys),
        dags_folder=get("DAGS_FOLDER", Path, default="dags"),
        stream_prefix=get("STREAM_PREFIX", _stream_prefix, default="deferral"),
        heartbeat_sec=get("HEARTBEAT_SEC", _positive_float, default="5"),
        triggerer_capacity=get("TRIGGERER_CAPACITY", _positive_int, default="1000"),
        trigger_modules=get("TRIGGER_MODULES", _module_prefixes, default="deferral.triggers"),
        default_deferrable=get("DEFAULT_DEFERRABLE", _bool, default="false"),
    )


def default_deferrable() -> bool:
    """``DEFERRAL_DEFAULT_DEFERRABLE``, read on its own: DAG files are parsed by processes
    (and tests) that need no other setting."""
    raw = os.environ.get(ENV_PREFIX + "DEFAULT_DEFERRABLE", "false")
    try:
        return _bool(raw)
    except ValueError:
        raise ConfigError(
            f"{ENV_PREFIX}DEFAULT_DEFERRABLE is malformed: expected true or false"
        ) from None
