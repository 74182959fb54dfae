"""The disk tier's fresh records: index records of its latest puts, kept in
memory until they are merged into lmdb many at a time (tiers/disk.py).

A record written into lmdb one put batch at a time costs a commit per
batch, and each of its random keys dirties a page of the B-tree: 11 us per
block at 20k blocks and 36 us at 1M, 3-10x the raw write of a small
block's slot (docs/benchmarks.md, #19). Fresh records are merged
`MERGE_RECORDS` at a time instead (or `MERGE_BYTES` of objects), in a few large
transactions.

Durability does not wait for the merge: a put's slots are durable (each
begins with a header naming its block, size and checksum) before its
records are fresh, and the index carries a dirty flag, set before the
first such put and cleared by the merge at a clean close. An index found
dirty at open was left with slots no record may name: the tier then hands
out slots only past the end of its segment files until its sweep has read
the slots no record names (tiers/disk_sweep.py) and indexed those that
hold a whole block again.
"""
from __future__ import annotations

import threading
from typing import Sequence

from tiers.disk_index import record_size
from tiers.types import BlockHash

# fresh records merged at once (154 B of memory each, ~40 MiB in all): a merge of N sorted records into a large
# index dirties about min(N, its leaf pages) pages, so the cost per record falls with N; into 3M records, 3.3 us
# a record at 262,144 against 8.7 at 65,536 (#19)
MERGE_RECORDS = 262144
MERGE_BYTES = 1 << 30  # or once they describe this many bytes of objects: what a crash leaves the sweep to read again
# per merge transaction: lmdb keeps the pages a transaction changes in memory until it commits, a 4 KiB page
# per new random key once the tree is large (65k keys: ~250 MiB at 3M blocks; 8,192: ~32 MiB)
MERGE_TXN = 8192


class FreshRecords:
    """Records not yet in lmdb, with their totals. Thread-safe; the tier
    changes them under its commit lock and removes merged ones only once
    their transaction has committed, so a reader that misses one here finds
    it in lmdb."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recs: dict[BlockHash, bytes] = {}
        self._bytes = 0
        self.marks: dict[int, int] = {}  # the slot marks as of the latest `add`, merged with the records

    def __len__(self) -> int:
        return len(self._recs)

    def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """The fresh record of each hash (None: not fresh)."""
        if not self._recs:
            return [None] * len(hashes)
        with self._lock:
            return list(map(self._recs.get, hashes))

    def add(self, recs: dict[BlockHash, bytes], nbytes: int, marks: dict[int, int]) -> None:
        """New records (of hashes no record names yet) of objects of `nbytes` in all, and the slot marks now."""
        with self._lock:
            self.marks = marks
            self._recs.update(recs)
            self._bytes += nbytes

    def pop(self, hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, bytes]]:
        """Remove the fresh records of these hashes (deleted); those there were."""
        out = []
        with self._lock:
            for h in hashes:
                v = self._recs.pop(h, None)
                if v is not None:
                    self._bytes -= record_size(v)
                    out.append((h, v))
        return out

    def due(self) -> bool:
        """Whether enough wait for a merge."""
        return len(self._recs) >= MERGE_RECORDS or self._bytes >= MERGE_BYTES

    def batch(self) -> dict[BlockHash, bytes]:
        """Every fresh record."""
        with self._lock:
            return dict(self._recs)

    def merged(self, recs: dict[BlockHash, bytes]) -> None:
        """`recs` (a `batch`) are in lmdb now: drop them here."""
        with self._lock:
            if recs == self._recs:  # the usual case, all of them (one C comparison, not a loop in Python)
                self._recs, self._bytes = {}, 0
                return
            for h, v in recs.items():
                if self._recs.get(h) == v:
                    del self._recs[h]
                    self._bytes -= record_size(v)

    def clear(self) -> None:
        """Forget them all (the index was rebuilt from the slots, which hold them)."""
        with self._lock:
            self._recs.clear()
            self._bytes = 0

    def totals(self) -> tuple[int, int]:
        """(records, bytes of the objects they describe)."""
        with self._lock:
            return len(self._recs), self._bytes
