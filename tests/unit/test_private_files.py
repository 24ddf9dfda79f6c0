"""Files holding secrets are created readable by their owner only, whatever the umask, and an
existing file others could read is replaced, not written into."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from deferral.runtime.private_files import write_private
from deferral_cli import embedded as standalone


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: a mode that holds under it does not come from the umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_is_created_owner_only(tmp_path: Path, open_umask: None) -> None:
    target = tmp_path / "out.json"
    write_private(target, "secret\n")
    assert target.read_text() == "secret\n" and _mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_file_others_could_read_is_replaced(tmp_path: Path, open_umask: None) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    target.chmod(0o666)
    inode = target.stat().st_ino
    write_private(target, "new")
    assert target.read_text() == "new" and _mode(target) == 0o600
    assert target.stat().st_ino != inode  # a new file, never the readable one rewritten


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        write_private(tmp_path / "no_such_dir" / "out.json", "x")
    assert list(tmp_path.iterdir()) == []


def test_the_standalone_modes_secret_files_are_owner_only(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "fernet.key"
    made = standalone._secret_file(path, lambda: "k3y")
    assert made == "k3y" and _mode(path) == 0o600
    assert standalone._secret_file(path, lambda: "other") == "k3y"  # kept, not made again
