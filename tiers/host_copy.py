"""Host memory for the slot pools: batched copies, copies followed by a
digest while the bytes are still in cache, and pools other processes map."""
from __future__ import annotations

import mmap
import os
from typing import Callable

import numpy as np
import torch

try:  # batched host copies without per-copy interpreter overhead (setup.py builds it)
    from cache_service._fastcopy import copy_many
except ImportError:  # pragma: no cover - no C compiler where installed
    copy_many = None

FUSE_BYTES = 512 << 10  # copied, then digested while still in a core's L2 (1 MiB on these machines)


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`dst.copy_(src)` for each pair, then wait for any async device copies.

    A copy between a pinned host tensor and a GPU one may run asynchronously;
    issuing all of them before one wait per device overlaps the batch, and the
    wait guarantees no slot is reused or handed out while a copy still reads
    or writes it.
    """
    if copy_many is not None and all(host_bytes(d) and host_bytes(s) for d, s in pairs):
        copy_many([d.numpy() for d, _ in pairs], [s.numpy() for _, s in pairs])
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


def host_bytes(t: torch.Tensor) -> bool:
    """A contiguous uint8 CPU tensor: its numpy view shares the bytes."""
    return t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous()


def copy_then(pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Callable[[np.ndarray], object]) -> list:
    """`copy_all` for host tensors (1-D contiguous uint8), in groups of about
    FUSE_BYTES, with after(dst as a numpy array) of each copy computed right
    after its group: a checksum then reads the bytes from cache, not memory
    (about the cost of the copy alone, docs/benchmarks.md)."""
    dsts, srcs = [d.numpy() for d, _ in pairs], [s.numpy() for _, s in pairs]
    out: list = []
    lo = size = 0
    for k, d in enumerate(dsts):
        if k > lo and size + d.size > FUSE_BYTES:
            out.extend(_copy_group(dsts[lo:k], srcs[lo:k], after))
            lo, size = k, 0
        size += d.size
    out.extend(_copy_group(dsts[lo:], srcs[lo:], after))
    return out


def _copy_group(dsts: list[np.ndarray], srcs: list[np.ndarray], after) -> list:
    if copy_many is not None:
        copy_many(dsts, srcs)
    else:
        for d, s in zip(dsts, srcs):
            d[:] = s
    return [after(d) for d in dsts]


def shared_matrix(num_slots: int, slot_bytes: int, name: str) -> tuple[torch.Tensor, int, int]:
    """([num_slots, slot_bytes] uint8 view of a memfd mapping, its fd, the row
    stride): rows page-aligned, so a client maps the same rows at the same offsets."""
    stride = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    fd = os.memfd_create(f"tierkv-{name}-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, num_slots * stride)
        mm = mmap.mmap(fd, num_slots * stride, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    rows = torch.frombuffer(mm, dtype=torch.uint8).view(num_slots, stride)[:, :slot_bytes]
    return rows, fd, stride  # the tensor keeps the mapping alive
