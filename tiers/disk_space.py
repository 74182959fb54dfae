"""Which slots of the disk tier's segment files are free (tiers/disk.py,
tiers/disk_slots.py), without reading the index at open.

Per slot size: a high-water mark (slots ever handed out; kept in the
index's meta record with each put's commit) and a stack of free slots
below it (8 bytes each). At open only the marks are known: new blocks go
past them, and the slots below that deleted blocks left free are found
by the sweep's walk over the index (`seen` per record, `walked` at its
end), after which they are handed out again. A slot is free again only
once the delete of its block is committed, so a crash never leaves two
records on one slot; a put that fails gives its slot back.
"""
from __future__ import annotations

import threading
from array import array
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from tiers.disk_slots import Segments, slot_size, slot_sizes

_ROW = np.dtype([("size", "<u8"), ("csum", "<u8"), ("slot", "<u8"), ("atime", "<u8")])  # tiers/disk_index.RECORD


class FreeSlots:
    """Free slots per slot size; see the module docstring. Thread-safe."""

    def __init__(self, marks: dict[int, int]) -> None:
        self._lock = threading.Lock()
        self._reset(marks, {})
        self._seen: dict[int, np.ndarray] | None = {c: np.zeros(m, dtype=bool) for c, m in marks.items()}

    def _reset(self, marks: dict[int, int], free: dict[int, list[int]]) -> None:
        self.marks = dict(marks)
        self._opened = dict(marks)  # below these, free slots are unknown until the walk
        self._free = {c: array("Q", sorted(f, reverse=True)) for c, f in free.items()}

    def take(self, size: int) -> int:
        """A free slot for an object of `size` bytes (past the mark if none)."""
        return self.take_many([size])[0]

    def take_many(self, sizes: Sequence[int]) -> list[int]:
        """`take` for each of `sizes`, under one hold of the lock."""
        if sizes and sizes.count(sizes[0]) == len(sizes):
            return self._take_alike(slot_size(sizes[0]), len(sizes))
        out = []
        with self._lock:
            for size in sizes:
                c = slot_size(size)
                free = self._free.get(c)
                if free:
                    out.append(free.pop())
                else:
                    out.append(self.marks.get(c, 0))
                    self.marks[c] = out[-1] + 1
        return out

    def _take_alike(self, c: int, n: int) -> list[int]:
        """n slots of `c` bytes: as `take_many` gives them (free ones last freed first, then past the mark)."""
        with self._lock:
            free = self._free.get(c)
            k = min(n, len(free)) if free else 0
            out = free[len(free) - k:].tolist()[::-1] if k else []
            if k:
                del free[len(free) - k:]
            mark = self.marks.get(c, 0)
            self.marks[c] = mark + n - k
            return out + list(range(mark, mark + n - k))

    def write_into(self, segments: Segments, hashes: Sequence[bytes], objs: Sequence[torch.Tensor],
                   durable: bool = False) -> tuple[list[tuple[bytes, int, int, int]], set[tuple[int, int]], OSError | None]:
        """Write the objects (1-D uint8 CPU tensors) into free slots of
        `segments` (`durable`: and sync them, `Segments.write_many`): (hash,
        size, checksum, slot) of each written, the files to sync, the first
        error met; the slot of one not written is free again."""
        sizes = [o.numel() for o in objs]
        slots = self.take_many(sizes)
        sums, files, err = segments.write_many(hashes, objs, slots, durable)
        for n, s, csum in zip(sizes, slots, sums):
            if csum is None:
                self.give(n, s)
        return [(h, n, c, s) for h, n, s, c in zip(hashes, sizes, slots, sums) if c is not None], files, err

    def give(self, size: int, s: int) -> None:
        """Slot `s` (of an object of `size` bytes) is free again."""
        c = slot_size(size)
        with self._lock:
            seen = self._seen.get(c) if self._seen is not None else None
            if seen is not None and s < len(seen):
                seen[s] = False  # below the open mark: the walk's end frees it
            else:
                self._free.setdefault(c, array("Q")).append(s)

    def seen(self, values: list[bytes]) -> None:
        """The walk met these index records: their slots are in use."""
        if self._seen is None or not values:
            return
        rows = np.frombuffer(b"".join(values), dtype=_ROW)
        slots = slot_sizes(rows["size"])
        with self._lock:
            for c in np.unique(slots):
                seen = self._seen.get(int(c))
                if seen is not None:
                    s = rows["slot"][slots == c]
                    seen[s[s < len(seen)].astype(np.int64)] = True

    def holes(self) -> dict[int, np.ndarray]:
        """Per slot size, the slots below the open marks the walk has not met
        (so far: free, or written by a put no record names yet)."""
        with self._lock:
            return {c: np.flatnonzero(~seen) for c, seen in (self._seen or {}).items()}

    def walked(self) -> int:
        """The walk is over: free the slots below the open marks it did not
        meet (nor a recovery since). Returns how many were freed."""
        with self._lock:
            if self._seen is None:
                return 0
            n = 0
            for c, seen in self._seen.items():
                holes = np.flatnonzero(~seen)[::-1]
                self._free.setdefault(c, array("Q")).extend(holes.astype(np.uint64).tolist())
                n += len(holes)
            self._seen = None
            return n

    def rebuilt(self, marks: dict[int, int], used: dict[int, set[int]], opening: bool) -> dict[int, int]:
        """After the index was rebuilt from the slots (`used` per slot size,
        `marks` past them): at open, every other slot below the marks is
        free; later, puts may hold slots no record names yet, so the marks
        only rise and the free slots stay as they were (holes the rebuild
        left wait for the next open's walk). Returns the marks to keep."""
        with self._lock:
            if opening:
                self._reset(marks, {c: [s for s in range(m) if s not in used.get(c, ())] for c, m in marks.items()})
            else:
                for c, m in marks.items():
                    self.marks[c] = max(self.marks.get(c, 0), m)
                for c, f in self._free.items():  # a freed copy a racing put left whole may be indexed now
                    self._free[c] = array("Q", [s for s in f if s not in used.get(c, ())])
            self._seen = None
            return dict(self.marks)

    def known(self) -> bool:
        """Whether the free slots below the open marks are known yet."""
        return self._seen is None

    def spare_bytes(self) -> int:
        """Bytes in free slots (segment space held but unused)."""
        with self._lock:
            return sum(c * len(f) for c, f in self._free.items())


class WritesInFlight:
    """A put's slot writes, which run outside the tier's commit lock, and
    what must not run beside them: a close (it closes the files they write
    to) and a heal's scan of every slot (it clears headers it finds torn).
    `writing` around a put's writes; `quiet` waits for those in flight and
    holds new ones back until it ends (nothing inside `writing` may wait for
    the commit lock: a heal holds it while quiet)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writing = self._quiet = 0

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._quiet)
            self._writing += 1
        try:
            yield
        finally:
            with self._cond:
                self._writing -= 1
                self._cond.notify_all()

    @contextmanager
    def quiet(self) -> Iterator[None]:
        with self._cond:
            self._quiet += 1
            self._cond.wait_for(lambda: not self._writing)
        try:
            yield
        finally:
            with self._cond:
                self._quiet -= 1
                self._cond.notify_all()
