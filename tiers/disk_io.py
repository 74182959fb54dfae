"""File and thread helpers of the disk tier (tiers/disk.py): the shared
read threads, read buffers, the root's lock, data file names, durable
writes, checked reads, fsyncs, and the records of whole data files."""
from __future__ import annotations

import fcntl
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Callable

import torch
import xxhash

from tiers.arena import Arena
from tiers.disk_index import RECORD
from tiers.types import HASH_BYTES, BlockHash, TierUnavailableError

_HEX_DIGITS = "0123456789abcdef"

READ_THREADS = 8
SYNC_THREADS = 8
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


def syncers() -> ThreadPoolExecutor:
    """Threads that fsync a batch's files concurrently: a device flushes
    many files at once in about the time of one (1.4-3.5x the rate of
    fsyncs one after another on the VM disk of docs/benchmarks.md)."""
    return _pool("sync", SYNC_THREADS)


def fsync_all(fds: list[int]) -> list[OSError | None]:
    """fsync each open file (concurrently); the error per file, None where it worked."""
    def one(fd: int) -> OSError | None:
        try:
            os.fsync(fd)
        except OSError as e:
            return e
        return None

    return list(syncers().map(one, fds)) if len(fds) > 1 else [one(fd) for fd in fds]


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


def write_file(path: Path, data: memoryview) -> int:
    """Write `data` to a new file at `path`; its fd, still open (the caller
    fsyncs and closes it). On any OSError the file is removed and the error raised."""
    fd = -1
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        while data:
            data = data[os.write(fd, data):]
        return fd
    except OSError:
        if fd >= 0:
            os.close(fd)
        unlink_quiet(path)
        raise


def read_file(path: Path, size: int, csum: int, buf: torch.Tensor) -> bool:
    """Read the file at `path` into `buf`: True if it has `size` bytes whose
    xxh3_64 is `csum`; False for a missing, short or different file."""
    view = memoryview(buf.numpy())
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != size:
                return False
            n = 0
            while n < size:
                got = f.readinto(view[n:])
                if not got:
                    return False
                n += got
    except FileNotFoundError:
        return False
    return xxhash.xxh3_64_intdigest(view[:size]) == csum


def whole_files(data: Path, check: Callable[[BlockHash, memoryview], bool] | None,
                skip: str) -> tuple[dict[bytes, bytes], int]:
    """(index records of the files in `data` that `check` finds whole, files
    looked at); the others are removed. Files whose name holds `skip` are
    left alone (puts in flight). Without a check no file is trusted."""
    kept, seen = {}, 0
    for f in os.scandir(data):
        if not f.is_file(follow_symlinks=False) or skip in f.name:
            continue
        seen += 1
        h = parse_name(f.name)
        try:
            body = Path(f.path).read_bytes() if h is not None and check is not None else b""
        except OSError:
            body = b""
        if body and check(h, memoryview(body)):
            kept[h] = RECORD.pack(len(body), xxhash.xxh3_64_intdigest(body), f.stat().st_mtime_ns)
        else:
            unlink_quiet(f.path)
    return kept, seen
