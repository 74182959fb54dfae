"""A small tmpfs for the tests of a filesystem that runs out of space (real ENOSPC)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import in_ci


def mount_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of `size` at `path` (made here); False where this process cannot (not root)."""
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def require_tmpfs(path: Path, size: str) -> None:
    """`mount_tmpfs`, or the test cannot run: CI runs as root, so there that is a failure, elsewhere a skip."""
    if not mount_tmpfs(path, size):
        why = f"cannot mount a {size} tmpfs (needs root)"
        pytest.fail(why) if in_ci() else pytest.skip(why)


def unmount(path: Path) -> None:
    """Lazily: a failed assertion may leave a tier's lmdb open on it."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
