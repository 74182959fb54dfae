"""Sampled LRU over a tier's own access times: no per-block state here.

For a tier of millions of blocks (the disk tier: its lmdb index holds each
block's last access), a policy that mirrors every block in Python objects
costs hundreds of bytes per block and a walk over every key at open. This
one keeps only a short pool of candidates the tier names (`Tier.oldest`:
the least recently used of its records exactly while it holds a few
thousand blocks, else the oldest of random draws, as Redis's sampled LRU
does) and evicts from the pool's oldest end. A block read or stored again
leaves the pool (the tier has its new access time).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from cache_service.store.eviction.base import EvictionPolicy, PinnedFn
from tiers.types import BlockHash, ConfigError

if TYPE_CHECKING:
    from tiers.base import Tier

_POOL = 32  # candidates asked of the tier at a time
_DRAWS = 256  # random records they are the oldest of, past the exact range
_REFILLS = 256  # per victim, before deciding every sampled block is pinned (the exact range is 4,096 blocks)


class SampledLRUPolicy(EvictionPolicy):
    """Least recently used, from the tier's own records; see the module docstring."""

    name = "sampled"
    rebuilt_from_keys = False  # nothing to rebuild at open: the tier has it

    def __init__(self, capacity_blocks: int, source: "Tier | None" = None) -> None:
        super().__init__(capacity_blocks)
        if source is None or not source.keeps_recency:
            raise ConfigError("policy 'sampled' needs a tier that keeps its blocks' access times (disk)")
        self._tier = source
        self._pool: dict[BlockHash, None] = {}  # candidates, oldest first
        self._taken: set[BlockHash] = set()  # victims handed out, until the tier no longer holds them
        # pinned candidates met, skipped until unpinned: the oldest blocks may stay pinned for long (idle
        # pinned sessions), and asked again at every call they would crowd out the evictable ones
        self._passed: set[BlockHash] = set()
        self._prune_at = 4 * _POOL

    def insert(self, h: BlockHash) -> None:
        self._pool.pop(h, None)
        self._taken.discard(h)
        self._passed.discard(h)

    def touch(self, h: BlockHash) -> None:
        self._pool.pop(h, None)

    def remove(self, h: BlockHash) -> None:
        self._pool.pop(h, None)
        self._taken.discard(h)
        self._passed.discard(h)

    def victim(self, pinned: PinnedFn) -> BlockHash | None:
        for refills in range(_REFILLS):
            while self._pool:
                h = next(iter(self._pool))
                del self._pool[h]
                if h in self._taken:
                    continue
                if pinned(h):
                    self._passed.add(h)
                    continue
                self._taken.add(h)
                return h
            if not refills:  # the tier names candidates only at a refill: those unpinned since may come again
                self._passed = {h for h in self._passed if pinned(h)}
            if not self._refill():
                return None
        return None

    def _refill(self) -> bool:
        """Ask the tier for candidates; False when it names none."""
        if len(self._taken) > self._prune_at:  # forget victims the store has deleted since
            taken = list(self._taken)
            self._taken = {h for h, held in zip(taken, self._tier.contains_many(taken)) if held}
            self._prune_at = max(4 * _POOL, 2 * len(self._taken))
        taken, passed = self._taken, self._passed
        found = self._tier.oldest(_POOL, _DRAWS, lambda h: h in taken or h in passed)
        self._pool.update(dict.fromkeys(found))
        return bool(found)

    def __len__(self) -> int:
        return self._tier.stats.blocks

    def __contains__(self, h: object) -> bool:
        return self._tier.contains_many([h])[0]
