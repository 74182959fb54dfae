"""File and thread helpers of the disk tier (tiers/disk.py): the shared
read threads, read buffers, the root's lock, data file names, fsyncs."""
from __future__ import annotations

import fcntl
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import torch

from tiers.arena import Arena
from tiers.types import HASH_BYTES, BlockHash, TierUnavailableError

_HEX_DIGITS = "0123456789abcdef"

READ_THREADS = 8
_readers_pool: ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()


def readers() -> ThreadPoolExecutor:
    """Threads that read a batch's files concurrently (shared by all disk
    tiers): one read at a time leaves an SSD or a virtual disk mostly idle,
    waiting out each read's latency in turn."""
    global _readers_pool
    with _readers_lock:
        if _readers_pool is None:
            _readers_pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tierkv-disk-read")
        return _readers_pool


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
    since opening one deletes files it does not know (another's temp files)."""
    fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TierUnavailableError(f"disk tier {root} is in use by another process") from None
    return fd


def parse_name(name: str) -> BlockHash | None:
    """The hash a data file is named after, or None for anything else."""
    if len(name) != 2 * HASH_BYTES or name.strip(_HEX_DIGITS):
        return None
    return BlockHash(bytes.fromhex(name))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str | os.PathLike) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)
