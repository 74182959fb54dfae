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

Free slots hold disk space, and each slot size has files of its own: a tier
whose blocks changed size (another model, another block size) would hold
its capacity again in every old size's free slots. So once the free slots
hold more space than the tier could still fill (its capacity less what it
stores) by a slack, some give theirs back to the filesystem (`reclaim`: the
sizes written least recently first, oldest freed first), and those slots are holes
until one is handed out again and allocated before its write
(`Segments.fill`). Free slots the tier can fill keep their space: deleting
blocks does not shrink the files, and the next put writes into allocated
blocks.
"""
from __future__ import annotations

import logging
import threading
from array import array
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from tiers.disk_geometry import slot_size, slot_sizes
from tiers.disk_slots import Segments

log = logging.getLogger(__name__)
_ROW = np.dtype([("size", "<u8"), ("csum", "<u8"), ("slot", "<u8"), ("atime", "<u8")])  # tiers/disk_index.RECORD


class FreeSlots:
    """Free slots per slot size; see the module docstring. Thread-safe."""

    def __init__(self, marks: dict[int, int]) -> None:
        self._lock = threading.Lock()
        self._reset(marks, {})
        self._seen: dict[int, np.ndarray] | None = {c: np.zeros(m, dtype=bool) for c, m in marks.items()}
        self._punching = True  # until the filesystem refuses
        self._taken: dict[int, int] = {}  # slot size -> when slots of it were last taken (a count of takes)
        self._takes = 0

    def _reset(self, marks: dict[int, int], free: dict[int, list[int]]) -> None:
        self.marks = dict(marks)
        self._opened = dict(marks)  # below these, free slots are unknown until the walk
        self._free = {c: array("Q", sorted(f, reverse=True)) for c, f in free.items()}
        self._holes: dict[int, array] = {}  # free slots whose space `reclaim` gave back
        self._epoch = getattr(self, "_epoch", 0) + 1  # a rebuild: slots out of the lists may be indexed now

    def take(self, size: int) -> int:
        """A free slot for an object of `size` bytes (past the mark if none)."""
        return self.take_many([size])[0]

    def take_many(self, sizes: Sequence[int]) -> list[int]:
        """`take` for each of `sizes`, under one hold of the lock."""
        return self._take(sizes)[0]

    def _take(self, sizes: Sequence[int]) -> tuple[list[int], dict[int, list[int]]]:
        """`take_many`, and the slots handed out that are holes (per slot size):
        free slots first (the last freed), then holes, then past the mark; a
        batch of one size gets them in file order."""
        if sizes and sizes.count(sizes[0]) == len(sizes):
            c = slot_size(sizes[0])
            out, holes = self._take_alike(c, len(sizes))
            return out, {c: holes} if holes else {}
        out, holes = [], {}
        with self._lock:
            for size in sizes:
                c = slot_size(size)
                self._took(c)
                free, hole = self._free.get(c), self._holes.get(c)
                if free:
                    out.append(free.pop())
                elif hole:
                    out.append(hole.pop())
                    holes.setdefault(c, []).append(out[-1])
                else:
                    out.append(self.marks.get(c, 0))
                    self.marks[c] = out[-1] + 1
        return out, holes

    def _take_alike(self, c: int, n: int) -> tuple[list[int], list[int]]:
        """n slots of `c` bytes as `_take` picks them, in file order (a batch of slots freed last first
        is written backwards otherwise: 1.6x the time of forwards for 368 KiB blocks here), and which
        of them are holes."""
        with self._lock:
            self._took(c)
            out = _pop(self._free.get(c), n)
            holes = _pop(self._holes.get(c), n - len(out))
            mark = self.marks.get(c, 0)
            end = self.marks[c] = mark + n - len(out) - len(holes)
        return sorted(out + holes) + list(range(mark, end)), holes

    def write_into(self, segments: Segments, hashes: Sequence[bytes], objs: Sequence[torch.Tensor],
                   sizes: Sequence[int], durable: bool = False
                   ) -> tuple[list[tuple[bytes, int, int, int]], set[tuple[int, int]], OSError | None]:
        """Write the objects (1-D uint8 CPU tensors of `sizes` bytes) into free
        slots of `segments` (`durable`: and sync them, `Segments.write_many`):
        (hash, size, checksum, slot) of each written, the files to sync, the
        first error met; the slot of one not written is free again."""
        slots, holes = self._take(sizes)
        unfilled, err = self._fill(segments, holes)
        at = [i for i, (n, s) in enumerate(zip(sizes, slots)) if (slot_size(n), s) not in unfilled] \
            if unfilled else range(len(slots))  # the usual batch: every slot is there to write
        sums: list[int | None] = [None] * len(slots)
        files: set[tuple[int, int]] = set()
        if at:
            cut = (lambda xs: xs) if len(at) == len(slots) else (lambda xs: [xs[i] for i in at])
            got, files, err2 = segments.write_many(cut(hashes), cut(objs), cut(slots), durable, cut(sizes))
            for i, csum in zip(at, got):
                sums[i] = csum
            err = err or err2
        if None in sums:
            for n, s, csum in zip(sizes, slots, sums):
                if csum is None and (slot_size(n), s) not in unfilled:
                    self.give(n, s)
        return [(h, n, c, s) for h, n, s, c in zip(hashes, sizes, slots, sums) if c is not None], files, err

    def _fill(self, segments: Segments, holes: dict[int, list[int]]) -> tuple[set[tuple[int, int]], OSError | None]:
        """Allocate the holes handed out; those that could not be (a full disk)
        are holes again: (slot size, slot) of each, and the first error."""
        unfilled: set[tuple[int, int]] = set()
        err = None
        for c, hs in holes.items():
            failed, e = segments.fill(c, hs)
            err = err or e
            if failed:
                unfilled |= {(c, s) for s in failed}
                with self._lock:
                    self._holes.setdefault(c, array("Q")).extend(sorted(failed, reverse=True))
        return unfilled, err

    def give(self, size: int, s: int) -> None:
        """Slot `s` (of an object of `size` bytes) is free again."""
        c = slot_size(size)
        with self._lock:
            seen = self._seen.get(c) if self._seen is not None else None
            if seen is not None and s < len(seen):
                seen[s] = False  # below the open mark: the walk's end frees it
            else:
                self._free.setdefault(c, array("Q")).append(s)

    def reclaim(self, segments: Segments, slack: int, room: int) -> int:
        """Once the free slots holding disk space pass `room` (the bytes the
        tier may still store) by `slack`, give back the space of free slots
        until they hold room + slack / 2: those of the sizes taken from least
        recently first (an old block size's), oldest freed first. Free
        slots the tier can fill within its capacity keep their space (a hole
        is allocated again before its next write, which costs a store of
        large blocks a quarter of its rate). Bytes given back."""
        with self._lock:
            free = sum(c * len(f) for c, f in self._free.items())
            if not self._punching or free <= room + slack:
                return 0
            cut, epoch, over = {}, self._epoch, free - room - slack // 2
            for c in sorted(self._free, key=lambda c: self._taken.get(c, 0)):
                f = self._free[c]
                k = min(len(f), -(-over // c))
                if k > 0:  # out of the lists while punched: nothing hands them out meanwhile
                    cut[c] = f[:k].tolist()
                    del f[:k]
                    over -= k * c
                if over <= 0:
                    break
        freed = 0
        try:
            for c, slots in cut.items():
                freed += segments.punch(c, slots)
        except OSError as e:
            self._punching = False
            log.warning("disk tier %s: free slots keep their disk space (giving it back failed: %s)",
                        segments.root, e)
        with self._lock:
            if self._epoch == epoch:  # after a rebuild they may be indexed: left out until the next open
                for c, slots in cut.items():
                    self._holes.setdefault(c, array("Q")).extend(slots[::-1])
        return freed

    def _took(self, c: int) -> None:
        """Slots of `c` bytes were just taken (caller holds the lock)."""
        self._takes += 1
        self._taken[c] = self._takes

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
                for free in (self._free, self._holes):  # a freed copy a racing put left whole may be indexed now
                    for c, f in free.items():
                        free[c] = array("Q", [s for s in f if s not in used.get(c, ())])
                self._epoch += 1
            self._seen = None
            return dict(self.marks)

    def known(self) -> bool:
        """Whether the free slots below the open marks are known yet."""
        return self._seen is None

    def spare_bytes(self) -> int:
        """Bytes in free slots that hold their disk space (not holes)."""
        with self._lock:
            return sum(c * len(f) for c, f in self._free.items())


def _pop(stack: array | None, n: int) -> list[int]:
    """The last `n` entries of `stack` (at most), removed, last first."""
    k = min(n, len(stack)) if stack else 0
    if not k:
        return []
    out = stack[len(stack) - k:].tolist()[::-1]
    del stack[len(stack) - k:]
    return out


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
