"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

Resident blocks are split into T1 (seen once recently) and T2 (seen at
least twice); B1 and B2 remember the hashes recently evicted from each.
``p`` is the adaptive target size of T1:

- a hit in T1 or T2 moves the block to T2's most-recent end;
- re-inserting a hash found in B1 means T1 was too small: p grows by
  max(|B2|/|B1|, 1); found in B2, p shrinks by max(|B1|/|B2|, 1); either
  way the block goes to T2;
- a new hash goes to T1; before that the directory is trimmed as in the
  paper's case IV: B1's oldest is dropped when |T1|+|B1| reaches c,
  otherwise B2's oldest when all four lists together reach 2c;
- ``victim`` is the paper's REPLACE: T1's least recent block when
  |T1| > p (or T2 is empty), else T2's; its hash moves to B1 or B2.

In this service the store decides when to evict and calls ``victim``
*before* ``insert`` of the incoming block, so REPLACE cannot see whether
the incoming hash is in B2 (the paper's tie-break at |T1| == p) and p
adapts right after the replacement instead of right before it. Ghost
entries are also held to at most c in total (the paper allows up to 2c
while the cache is not full). c is ``effective_capacity``: the tier's real
size in blocks once it has filled, even if ``capacity_blocks`` is a rough
estimate.

Pinned blocks met by ``victim`` are treated as just hit (moved to T2's
most-recent end), so they leave a small, fast-cycling T1 at once instead
of being met again on every call; when one list is all pinned the other
is tried.
"""
from __future__ import annotations

from collections import OrderedDict

from cache_service.store.eviction.base import EvictionPolicy, PinnedFn
from tiers.types import BlockHash

_List = OrderedDict[BlockHash, None]  # front = least recent


class ARCPolicy(EvictionPolicy):
    """ARC over block hashes: T1/T2 resident, B1/B2 ghosts, adaptive p."""

    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._t1: _List = OrderedDict()
        self._t2: _List = OrderedDict()
        self._b1: _List = OrderedDict()
        self._b2: _List = OrderedDict()
        self._p = 0.0

    @property
    def target_t1(self) -> float:
        """The adaptive target ``p`` for T1's size, in [0, effective_capacity]."""
        return self._p

    def insert(self, h: BlockHash) -> None:
        c = self.effective_capacity
        if h in self._t1 or h in self._t2:
            self.touch(h)
        elif h in self._b1:
            self._p = min(c, self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[h]
            self._t2[h] = None
        elif h in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[h]
            self._t2[h] = None
        else:
            self._make_directory_room()
            self._t1[h] = None
        self._note_size()

    def _make_directory_room(self) -> None:
        """Paper's case IV trimming, done before a new hash joins T1."""
        c = self.effective_capacity
        if len(self._t1) + len(self._b1) >= c:
            # When T1 alone fills c the paper evicts T1's LRU here; the store
            # owns eviction, so T1 just runs over until the store asks.
            if self._b1:
                self._b1.popitem(last=False)
        elif self._b2 and len(self) + self.ghost_count() >= 2 * c:
            self._b2.popitem(last=False)

    def touch(self, h: BlockHash) -> None:
        if h in self._t1:
            del self._t1[h]
            self._t2[h] = None
        elif h in self._t2:
            self._t2.move_to_end(h)

    def remove(self, h: BlockHash) -> None:
        if h in self._t1:
            del self._t1[h]
        else:
            self._t2.pop(h, None)

    def victim(self, pinned: PinnedFn) -> BlockHash | None:
        from_t1 = bool(self._t1) and (len(self._t1) > self._p or not self._t2)
        order = ((self._t1, self._b1), (self._t2, self._b2))
        for lst, ghost in order if from_t1 else order[::-1]:
            h = self._least_recent_unpinned(lst, pinned)
            if h is not None:
                del lst[h]
                ghost[h] = None
                self._trim_ghosts()
                return h
        return None

    def _least_recent_unpinned(self, lst: _List, pinned: PinnedFn) -> BlockHash | None:
        """First unpinned hash from ``lst``'s least-recent end; the pinned
        ones passed over are moved as if hit (to T2's most-recent end)."""
        skipped: list[BlockHash] = []
        chosen = None
        for h in lst:
            if not pinned(h):
                chosen = h
                break
            skipped.append(h)
        for h in skipped:
            self.touch(h)
        return chosen

    def _trim_ghosts(self) -> None:
        """Keep |T1|+|B1| <= c (when B1 has entries) and |B1|+|B2| <= c."""
        c = self.effective_capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._b1) + len(self._b2) > c:
            (self._b2 or self._b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, h: object) -> bool:
        return h in self._t1 or h in self._t2

    def ghost_count(self) -> int:
        return len(self._b1) + len(self._b2)

    def list_of(self, h: BlockHash) -> str | None:
        """Which list holds ``h``: "t1", "t2", "b1", "b2" or None (for stats and tests)."""
        for label, lst in (("t1", self._t1), ("t2", self._t2), ("b1", self._b1), ("b2", self._b2)):
            if h in lst:
                return label
        return None

    def _check(self) -> None:
        """Internal consistency of the four lists (used by tests)."""
        c = self.effective_capacity
        lists = (self._t1, self._t2, self._b1, self._b2)
        assert sum(map(len, lists)) == len(set().union(*lists)), "ARC lists overlap"
        assert 0.0 <= self._p <= c
        assert self.ghost_count() <= c
        assert not self._b1 or len(self._t1) + len(self._b1) <= c

