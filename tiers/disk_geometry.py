"""Where block objects live in the disk tier's segment files (tiers/disk_slots.py):
the slot header's format, slot sizes, files and offsets, and the files' names."""
from __future__ import annotations

import struct
from functools import lru_cache
from typing import Iterator, Sequence

import numpy as np

HEAD = struct.Struct("<4sIQ16s")  # magic, object size, xxh3_64 of the object, block hash
MAGIC = b"TKVS"
SEGMENT_BYTES = 1 << 30  # per segment file (at least one slot)
PAGED = 8192  # slots of objects (with their header) past this size are whole 4 KiB pages
PAGE = 4096


def slot_size(size: int) -> int:
    """The slot an object of `size` bytes takes: header + object, rounded to
    4 KiB for page-sized objects and to 256 B for small ones."""
    need = HEAD.size + size
    step = PAGE if need > PAGED else 256
    return -(-need // step) * step


def padding(sizes: Sequence[int]) -> int:
    """What objects of `sizes` bytes are written up to (`write_slots`' align):
    the end of their slots when all of them are slots of whole pages (a last
    page written in part is read in by the kernel first, unless cached: a
    store of large blocks at a quarter less than the disk's rate); else 0,
    nothing past the object (small slots share pages)."""
    return PAGE if sizes and min(sizes) + HEAD.size > PAGED else 0


def slot_sizes(sizes: np.ndarray) -> np.ndarray:
    """`slot_size` of each of `sizes` (uint64 array)."""
    need = sizes.astype(np.int64) + HEAD.size
    step = np.where(need > PAGED, PAGE, 256)
    return -(-need // step) * step


def per_file(slot: int) -> int:
    """Slots of `slot` bytes in one segment file."""
    return max(1, SEGMENT_BYTES // slot)


def place(size: int, s: int) -> tuple[tuple[int, int], int]:
    """((slot size, file number), offset of the slot) of slot `s` for an object of `size` bytes."""
    slot = slot_size(size)
    return (slot, s // per_file(slot)), (s % per_file(slot)) * slot


@lru_cache(maxsize=1024)
def geometry(size: int) -> tuple[int, int]:
    """(slot size, slots per file) for objects of `size` bytes (`place` without recomputing them per block)."""
    return slot_size(size), per_file(slot_size(size))


def runs(c: int, slots: Sequence[int]) -> Iterator[tuple[tuple[int, int], int, int]]:
    """(file key, start, end) of each run of neighbouring slots of `c` bytes in one file."""
    per, run = per_file(c), []
    for s in [*sorted(slots), -2]:
        if run and (s != run[1] + 1 or s // per != run[0] // per):
            yield (c, run[0] // per), (run[0] % per) * c, (run[1] % per + 1) * c
            run = []
        run = [run[0] if run else s, s]


def name(key: tuple[int, int]) -> str:
    """The file name of segment `key` (slot size, file number)."""
    return f"{key[0]}-{key[1]}"


def parse(name: str) -> tuple[int, int] | None:
    """The key of a segment file's name, or None for anything else."""
    slot, _, n = name.partition("-")
    return (int(slot), int(n)) if slot.isdigit() and n.isdigit() else None
