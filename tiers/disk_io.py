"""File and thread helpers of the disk tier (tiers/disk.py): the shared
read threads, read buffers, the root's lock, directory fsyncs, and the
earlier one-file-per-block layout set aside."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tiers.arena import Arena
from tiers.types import TierUnavailableError

log = logging.getLogger(__name__)
OLD_LAYOUT = ".old-layout-"

READ_THREADS = 8
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(name: str, threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"tierkv-disk-{name}")
        return _pools[name]


def readers() -> ThreadPoolExecutor:
    """Threads that read a batch's files concurrently (shared by all disk
    tiers): one read at a time leaves an SSD or a virtual disk mostly idle,
    waiting out each read's latency in turn."""
    return _pool("read", READ_THREADS)


def buffers(arena: Arena, sizes: list[int]) -> list[torch.Tensor]:
    """Read buffers: rows of the tier's arena when all objects have the same
    size (the usual batch of one namespace), so the payloads handed out are
    evenly spaced in one buffer and a caller can take them as one batch
    without copying (connectors/vllm/pages.py), and the next batch reuses
    memory already faulted in once the caller has dropped them."""
    if sizes and all(n == sizes[0] for n in sizes):
        return arena.rows(len(sizes), sizes[0])
    return [torch.empty(n, dtype=torch.uint8) for n in sizes]


def lock_root(root: Path) -> int:
    """Take the exclusive flock on `root`: one process owns a tier directory,
    since it alone hands out the slots of its segment files."""
    fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TierUnavailableError(f"disk tier {root} is in use by another process") from None
    return fd


_FALLOC_KEEP_SIZE_PUNCH_HOLE = 0x01 | 0x02  # linux/falloc.h
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give bytes [offset, offset + length) of a file back to the filesystem
    (they read as zeros; the file keeps its size). Raises OSError
    (EOPNOTSUPP where the filesystem cannot)."""
    if _libc.fallocate(fd, _FALLOC_KEEP_SIZE_PUNCH_HOLE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside_old_layout(root: Path) -> None:
    """A tier directory of the one-file-per-block layout (`data/`, an index
    of its records) is a cache of another format: moved aside whole (the
    disk tier's sweep removes it), so the tier starts empty in the new one."""
    if not (root / "data").is_dir():
        return
    stamp = time.time_ns()
    for name in ("data", "index.lmdb"):
        if (root / name).exists():
            os.rename(root / name, root / f"{name}{OLD_LAYOUT}{stamp}")
    log.warning("disk tier %s: one-file-per-block data from an earlier version set aside (removed in the "
                "background); the tier starts empty", root)


def remove_old_layouts(root: Path) -> None:
    """Delete what `set_aside_old_layout` moved aside."""
    for p in root.glob(f"*{OLD_LAYOUT}*"):
        shutil.rmtree(p, ignore_errors=True)


class WriteErrors:
    """How a failed block write is reported: ENOSPC is a capacity condition,
    not an error (said at most every 10 s, not per block); anything else
    is logged and counted."""

    def __init__(self, root: Path) -> None:
        self.root, self._full_logged = root, -1e9

    def report(self, e: OSError) -> int:
        """Log `e`; the errors it counts for (0 or 1)."""
        if e.errno == errno.ENOSPC:
            now = time.monotonic()
            if now - self._full_logged >= 10.0:
                self._full_logged = now
                log.warning("disk tier %s: filesystem full; writes dropped until space frees up", self.root)
            return 0
        log.warning("disk tier %s: writing a block failed: %s", self.root, e)
        return 1
