"""Host memory for the slot pools: batched copies, copies hashed while the
bytes are still in cache, and pools other processes map."""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import torch
import xxhash
import xxhash._xxhash

try:  # batched host copies without per-copy interpreter overhead (setup.py builds it)
    from tiers._fastcopy import copy_hash_many, copy_many, hash_rows
except ImportError:  # pragma: no cover - no C compiler where installed
    copy_many = copy_hash_many = hash_rows = None

FUSE_BYTES = 1 << 20  # copied, then hashed while still in a core's L2 (1 MiB on these machines)


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`dst.copy_(src)` for each pair, then wait for any async device copies.

    A copy between a pinned host tensor and a GPU one may run asynchronously;
    issuing all of them before one wait per device overlaps the batch, and the
    wait guarantees no slot is reused or handed out while a copy still reads
    or writes it.
    """
    if copy_many is not None and all(host_bytes(d) and host_bytes(s) for d, s in pairs):
        copy_arrays([d.numpy() for d, _ in pairs], [s.numpy() for _, s in pairs])
        return
    devices: set[torch.device] = set()
    for dst, src in pairs:
        cross = dst.device != src.device
        host = src if dst.device.type == "cuda" else dst
        async_ok = cross and host.device.type == "cpu" and host.is_pinned()
        dst.copy_(src, non_blocking=async_ok)
        for t in (dst, src):
            if t.device.type == "cuda":
                devices.add(t.device)
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()


def copy_arrays(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray]) -> None:
    """``dsts[i][:len(srcs[i])] = srcs[i]`` (1-D contiguous uint8 numpy arrays),
    a large batch on two threads where two cores are ours (as torch's copy_ is)."""
    if copy_many is None:
        for d, s in zip(dsts, srcs):
            d[:len(s)] = s
        return
    in_halves(lambda a, b: copy_many(dsts[a:b], srcs[a:b]) or [], [len(s) for s in srcs])


def copy_spans(dsts: Sequence[tuple[int, int]], srcs: Sequence[tuple[int, int]]) -> bool:
    """`copy_arrays` for (address, length) spans of memory the caller keeps
    alive (a pool's slots, CPU tensors): no numpy view per block, a
    microsecond each at small blocks. False (nothing copied) without the C module."""
    if copy_many is None:
        return False
    in_halves(lambda a, b: copy_many(dsts[a:b], srcs[a:b]) or [], [n for _, n in srcs])
    return True


def host_bytes(t: torch.Tensor) -> bool:
    """A contiguous uint8 CPU tensor: its numpy view shares the bytes."""
    return t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous()


def copy_hashed(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray], skip: int = 0) -> list[int]:
    """``dsts[i][:len(srcs[i])] = srcs[i]`` (1-D contiguous uint8 numpy arrays)
    and the xxh3_64 of each copy's bytes from `skip` on, hashed right after
    they were copied, while they are still in the core's cache: about the
    cost of the copy alone, where copying then hashing reads memory twice
    (docs/benchmarks.md). One C call where built (with the xxhash package's
    own XXH3); the loop below is the reference, and takes a copy larger
    than FUSE_BYTES in pieces."""
    if copy_hash_many is not None and XXH3:
        return in_halves(lambda a, b: copy_hash_many(dsts[a:b], srcs[a:b], skip, XXH3), [len(s) for s in srcs])
    sums: list[int] = []
    for d, s in zip(dsts, srcs):
        n = len(s)
        if n <= FUSE_BYTES:
            _copy(d, s)
            sums.append(xxhash.xxh3_64_intdigest(d[skip:n]))
            continue
        state = xxhash.xxh3_64()
        for off in range(0, n, FUSE_BYTES):
            end = min(n, off + FUSE_BYTES)
            _copy(d[off:end], s[off:end])
            if end > skip:
                state.update(d[max(off, skip):end])
        sums.append(state.intdigest())
    return sums


def row_sums(rows: np.ndarray, skip: int = 0) -> list[int]:
    """The xxh3_64 of each row of a C-contiguous 2-D uint8 array from byte
    `skip` on: one C call where built; the loop is the reference."""
    assert rows.ndim == 2 and rows.dtype == np.uint8 and rows.flags.c_contiguous
    if hash_rows is not None and XXH3:
        return hash_rows(rows, skip, XXH3)
    return [xxhash.xxh3_64_intdigest(row[skip:]) for row in rows]


PARALLEL_BYTES = 8 << 20  # a batch this large is copied by two threads where two cores are ours
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def in_halves(work: Callable[[int, int], list], sizes: Sequence[int]) -> list:
    """`work(0, n)` (a list per item, for n items of `sizes` bytes), run as
    two halves of about equal bytes on two threads where two cores are ours
    and the batch is large: for work that releases the GIL (our C copies,
    xxhash), the second half runs beside the first."""
    half = _halfway(sizes)
    if half is None:
        return work(0, len(sizes))
    second = _helper().submit(work, half, len(sizes))
    return work(0, half) + second.result()


def _halfway(sizes: Sequence[int]) -> int | None:
    """Where to cut a batch in two halves of about equal bytes, or None to keep it on one thread."""
    total = sum(sizes)
    if _CORES < 2 or len(sizes) < 2 or total < PARALLEL_BYTES:
        return None
    done = 0
    for i, n in enumerate(sizes):
        done += n
        if 2 * done >= total:
            return max(1, min(i + 1, len(sizes) - 1))
    return None


@lru_cache(maxsize=1)
def _helper() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="tierkv-copy")


def _xxh3_address() -> int:
    """The address of the xxhash package's XXH3_64bits (its run-time
    dispatching variant where it has one), for copy_hash_many; 0 when it
    cannot be found or does not hash as the package's Python function does."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        fn = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits
        addr = ctypes.cast(fn, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0
    probe = np.arange(1000, dtype=np.uint8)
    ok = addr and copy_hash_many is not None and \
        copy_hash_many([np.empty_like(probe)], [probe], 3, addr) == [xxhash.xxh3_64_intdigest(probe[3:])]
    return addr if ok else 0


XXH3 = _xxh3_address()  # the xxhash package's XXH3_64bits, for our C loops (0: not found)


def _copy(d: np.ndarray, s: np.ndarray) -> None:
    if copy_many is not None:
        copy_many((d,), (s,))
    else:
        d[:len(s)] = s


def shared_matrix(num_slots: int, slot_bytes: int, name: str) -> tuple[torch.Tensor, int, int]:
    """([num_slots, slot_bytes] uint8 view of a memfd mapping, its fd, the row
    stride): rows page-aligned, so a client maps the same rows at the same offsets."""
    stride = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    fd = os.memfd_create(f"tierkv-{name}-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, num_slots * stride)
        # sealed at its size: a client given the fd cannot shrink it under our mapping (a SIGBUS here)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, num_slots * stride, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    rows = torch.frombuffer(mm, dtype=torch.uint8).view(num_slots, stride)[:, :slot_bytes]
    return rows, fd, stride  # the tensor keeps the mapping alive
