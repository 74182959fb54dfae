"""Recent deletes, so that bytes read before a delete are not written after it.

Two of the store's paths carry a block's bytes from one moment to a tier at a
later one outside the writer's in-flight map: the retry tick (read from the
upload journal or the tiers above, then put) and a write-back victim (read
out of the tier above under its lock, then queued for the tier below). A
delete between the read and the write would be undone. Each such path takes
a `mark()` before it reads and asks `deleted(mark, hashes)` where the write
happens, under the lock the delete also takes there (the tier's lock, or
``meta`` for the in-flight map); a journal record, which has no such lock,
is checked after it is made and forgotten again if a delete came.

A block counts as deleted from the moment its delete starts (`deleting`)
and, once it ends, for every mark taken before the end. Bounded: the
`most` latest ended deletes are remembered; a mark older than the oldest of
them is answered "deleted" for every block (a dropped write is a miss, never
a wrong answer).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, Sequence

from tiers.types import BlockHash


class DeleteLog:
    """Sequence-numbered deletes of the last `most` blocks, and those under way. Thread-safe."""

    def __init__(self, most: int = 1 << 16) -> None:
        assert most > 0
        self._most, self._lock = most, threading.Lock()
        self._seq = self._floor = 0  # marks below the floor predate what is remembered
        self._ended: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> sequence number its delete ended at
        self._running: dict[BlockHash, int] = {}  # hash -> deletes of it under way

    def mark(self) -> int:
        """Now, for a later `deleted` check."""
        with self._lock:
            return self._seq

    @contextmanager
    def deleting(self, hashes: Sequence[BlockHash]) -> Iterator[None]:
        """Around a delete of `hashes` from every tier."""
        with self._lock:
            for h in hashes:
                self._running[h] = self._running.get(h, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._seq += 1
                for h in hashes:
                    left = self._running.pop(h) - 1
                    if left:
                        self._running[h] = left
                    self._ended.pop(h, None)
                    self._ended[h] = self._seq
                while len(self._ended) > self._most:
                    self._floor = self._ended.popitem(last=False)[1]

    def deleted(self, mark: int, hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Those of `hashes` whose delete started before now and had not ended at `mark`."""
        with self._lock:
            if mark < self._floor:
                return set(hashes)
            return {h for h in hashes if h in self._running or self._ended.get(h, -1) > mark}
