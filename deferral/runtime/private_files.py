"""Files that hold secrets (exported Variables, the standalone mode's keys and passwords)."""

from __future__ import annotations

import os
from pathlib import Path

# What an exported file of secrets may be: read and written by its owner, by nobody else.
PRIVATE_FILE_MODE = 0o600


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as a file only its owner can read. It is created so (never
    readable by others, even for a moment), as a new file beside the old one that then replaces
    it: an existing file readable by others is not reused."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
