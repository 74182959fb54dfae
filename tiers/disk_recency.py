"""Last-access times of the disk tier's blocks (tiers/disk.py), and the
least recently used among them, without a Python object per block.

Each index record ends with its block's last access. Reads do not write the
index: the times they give wait here (`pending`) and go out with the
tier's next write transaction, guarded so that a record replaced meanwhile
keeps its own (`DiskIndex.write`'s `only_if`). `oldest` reads every record
while the tier is small (exact LRU), else draws random ones (hashes are
uniform, so a random key's successor is a fair pick) and keeps the oldest:
Redis's sampled LRU.
"""
from __future__ import annotations

import heapq
import random
import threading
import time
from typing import Callable, Iterable, Sequence

from tiers.disk_index import RECORD, walk
from tiers.types import HASH_BYTES, BlockHash

PENDING_ATIMES = 16384  # access times kept in memory before a read has them written
EXACT_LRU = 4096  # up to this many blocks, `oldest` reads every record
Scan = Callable[[bytes], list[tuple[bytes, bytes]]]  # records past a key, in key order
Sample = Callable[[list[bytes]], dict[bytes, bytes]]  # the record at or after each random key


class AccessTimes:
    """Access times given since the last index write, over the records'."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[BlockHash, bytes] = {}  # records with a newer access time than the index's
        self._clock = 0
        self._rng = random.Random()

    def tick(self) -> int:
        """A strictly increasing wall-clock timestamp (ns)."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    def ticks(self, n: int) -> list[int]:
        """n `tick`s at once (one batch's records)."""
        with self._lock:
            first = max(time.time_ns(), self._clock + 1)
            self._clock = first + n - 1
        return list(range(first, first + n))

    def read(self, found: Sequence[tuple[BlockHash, tuple[int, int, int, int]]]) -> bool:
        """These records were read now; True once enough wait to be written."""
        with self._lock:
            for h, e in found:
                self._clock = max(time.time_ns(), self._clock + 1)
                self._pending[h] = RECORD.pack(e[0], e[1], e[2], self._clock)
            return len(self._pending) >= PENDING_ATIMES

    def take(self) -> dict[bytes, bytes]:
        """The waiting records, to write (and forget here)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            return pending

    def waiting(self) -> bool:
        return bool(self._pending)

    def _apply(self, recs: Iterable[tuple[bytes, bytes]]) -> list[tuple[BlockHash, int]]:
        with self._lock:
            pending = self._pending
            return [(BlockHash(k), RECORD.unpack(pending.get(k, v))[3]) for k, v in recs]

    def every(self, scan: Scan) -> list[tuple[BlockHash, int]]:
        """(hash, last access) of every record."""
        return [r for chunk in walk(scan) for r in self._apply(chunk)]

    def oldest(self, n: int, draws: int, skip: Callable[[BlockHash], bool], held: int,
               scan: Scan, sample: Sample) -> list[BlockHash]:
        """`Tier.oldest` for a tier holding `held` blocks."""
        if held <= EXACT_LRU:
            recs = self.every(scan)
        else:
            with self._lock:
                draw = [self._rng.randbytes(HASH_BYTES) for _ in range(draws)]
            recs = self._apply(sample(draw).items())
        return [h for h, _ in heapq.nsmallest(n, ((h, t) for h, t in recs if not skip(h)), key=lambda r: r[1])]
