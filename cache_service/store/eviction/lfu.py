"""Least-frequently-used eviction with aging, O(1) per operation.

Blocks live in frequency buckets kept as a doubly linked list in increasing
frequency order (the constant-time LFU layout): an access moves a block
from bucket f to bucket f+1, created next to f when missing, and the victim
comes from the first bucket. Inside a bucket the order is by arrival, so
ties go to the block that reached that count first.

Aging rule: a logical clock counts accesses (``insert`` and ``touch``).
Every ``aging_period`` accesses -- default ``10 * effective_capacity``,
and never fewer than the number of resident blocks -- every count is halved
(``max(1, f // 2)``). A block that was hot long ago therefore loses half its
lead per period and is evicted once the blocks in current use out-count it,
while a block that stays hot keeps a count near twice its accesses per
period. The halving pass is O(resident) once per at least that many
accesses, so it is amortized O(1).
"""
from __future__ import annotations

from collections import OrderedDict

from cache_service.store.eviction.base import EvictionPolicy, PinnedFn
from tiers.types import BlockHash, ConfigError


class _Bucket:
    """All resident blocks with the same count, in arrival order."""

    __slots__ = ("freq", "items", "prev", "next")

    def __init__(self, freq: int) -> None:
        self.freq = freq
        self.items: OrderedDict[BlockHash, None] = OrderedDict()
        self.prev: _Bucket = self
        self.next: _Bucket = self


class LFUPolicy(EvictionPolicy):
    """Evicts the unpinned block with the lowest (aged) access count.

    A pinned block that ``victim`` passes over is credited with one access
    (without advancing the aging clock), so repeated calls climb past pinned
    blocks instead of rescanning them; aging takes the credit back once the
    block is unpinned and stops being used.
    """

    name = "lfu"

    def __init__(self, capacity_blocks: int, *, aging_period: int | None = None) -> None:
        super().__init__(capacity_blocks)
        if aging_period is not None and aging_period <= 0:
            raise ConfigError(f"lfu aging_period must be positive, got {aging_period!r}")
        self._aging_period = aging_period
        self._head = _Bucket(0)  # sentinel of the circular bucket list
        self._where: dict[BlockHash, _Bucket] = {}
        self._clock = 0

    @property
    def aging_period(self) -> int:
        """Accesses between two halvings of every count."""
        return self._aging_period or 10 * self.effective_capacity

    # -- bucket list -------------------------------------------------------
    def _bucket_after(self, node: _Bucket, freq: int) -> _Bucket:
        """The bucket for ``freq`` right after ``node``, linked in if new."""
        nxt = node.next
        if nxt is not self._head and nxt.freq == freq:
            return nxt
        b = _Bucket(freq)
        b.prev, b.next = node, nxt
        node.next = nxt.prev = b
        return b

    def _unlink_if_empty(self, b: _Bucket) -> None:
        if not b.items:
            b.prev.next, b.next.prev = b.next, b.prev

    def _bump(self, h: BlockHash) -> None:
        b = self._where[h]
        nb = self._bucket_after(b, b.freq + 1)
        del b.items[h]
        nb.items[h] = None
        self._where[h] = nb
        self._unlink_if_empty(b)

    def _tick(self) -> None:
        self._clock += 1
        if self._clock >= max(self.aging_period, len(self._where)):
            self._clock = 0
            self._halve()

    def _halve(self) -> None:
        """Halve every count; f -> max(1, f // 2) is monotone, so one ordered pass merges buckets."""
        buckets = []
        b = self._head.next
        while b is not self._head:
            buckets.append(b)
            b = b.next
        self._head.next = self._head.prev = self._head
        tail = self._head
        for b in buckets:
            f = max(1, b.freq >> 1)
            if tail is not self._head and tail.freq == f:
                for h in b.items:
                    tail.items[h] = None
                    self._where[h] = tail
                continue
            b.freq = f
            b.prev, b.next = tail, self._head
            tail.next = self._head.prev = b
            tail = b

    # -- policy interface --------------------------------------------------
    def insert(self, h: BlockHash) -> None:
        if h in self._where:
            self._bump(h)
        else:
            b = self._bucket_after(self._head, 1)
            b.items[h] = None
            self._where[h] = b
            self._note_size()
        self._tick()

    def touch(self, h: BlockHash) -> None:
        if h in self._where:
            self._bump(h)
            self._tick()

    def remove(self, h: BlockHash) -> None:
        b = self._where.pop(h, None)
        if b is not None:
            del b.items[h]
            self._unlink_if_empty(b)

    def victim(self, pinned: PinnedFn) -> BlockHash | None:
        skipped: list[BlockHash] = []
        chosen: BlockHash | None = None
        b = self._head.next
        # Walk buckets from the lowest count; each block is asked about once.
        while b is not self._head and chosen is None:
            for h in b.items:
                if not pinned(h):
                    chosen = h
                    break
                skipped.append(h)
            b = b.next
        if chosen is not None:
            self.remove(chosen)
        for h in skipped:
            self._bump(h)
        return chosen

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, h: object) -> bool:
        return h in self._where

    def _check(self) -> None:
        """Internal consistency of the bucket list (used by tests)."""
        seen = 0
        prev, b = self._head, self._head.next
        while b is not self._head:
            assert b.prev is prev and b.items, "bucket list links broken or empty bucket kept"
            assert prev is self._head or prev.freq < b.freq, "bucket counts not increasing"
            for h in b.items:
                assert self._where[h] is b
            seen += len(b.items)
            prev, b = b, b.next
        assert self._head.prev is prev and seen == len(self._where)
