"""Least-recently-used eviction on one OrderedDict (front = least recent)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from cache_service.store.eviction.base import EvictionPolicy, PinnedFn
from tiers.types import BlockHash


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted-or-touched unpinned block.

    A pinned block that ``victim`` passes over is moved to the most-recent
    end, as if it had been used: the next call starts past it instead of
    re-checking it, which keeps victim selection amortized O(1).
    """

    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def insert(self, h: BlockHash) -> None:
        self._order[h] = None
        self._order.move_to_end(h)
        self._note_size()

    def insert_many(self, hashes: Sequence[BlockHash]) -> None:
        order = self._order
        for h in hashes:
            order[h] = None
            order.move_to_end(h)
        self._note_size()

    def touch(self, h: BlockHash) -> None:
        if h in self._order:
            self._order.move_to_end(h)

    def remove(self, h: BlockHash) -> None:
        self._order.pop(h, None)

    def victim(self, pinned: PinnedFn) -> BlockHash | None:
        skipped: list[BlockHash] = []
        chosen: BlockHash | None = None
        # Each resident block is asked about at most once per call.
        for h in self._order:
            if not pinned(h):
                chosen = h
                break
            skipped.append(h)
        # Rotate after the walk: mutating an OrderedDict while iterating is an error.
        for h in skipped:
            self._order.move_to_end(h)
        if chosen is not None:
            del self._order[chosen]
        return chosen

    def victims(self, n: int, pinned: PinnedFn | None = None) -> list[BlockHash]:
        if pinned is not None:
            return super().victims(n, pinned)
        order = self._order  # no pins: the n least recent, one pass
        return [order.popitem(last=False)[0] for _ in range(min(n, len(order)))]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, h: object) -> bool:
        return h in self._order

    def _check(self) -> None:
        """Internal consistency (used by tests); nothing to cross-check here."""
        assert len(self._order) == len(set(self._order))
