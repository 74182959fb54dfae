"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache
eviction", SOSP'23): three FIFO queues and a 2-bit access counter.

- S (small, ~10% of the cache) admits new blocks. Most blocks are read once
  ("one-hit wonders"); they leave from S quickly and only their hash is
  remembered in G.
- M (main) holds blocks that proved useful: read at least once while in S,
  or re-inserted while still remembered in G.
- G (ghost) is a FIFO of evicted hashes, as long as M's share of the cache.

Shares are taken of ``effective_capacity`` (the real number of blocks the
tier holds once it has filled), so a rough ``capacity_blocks`` estimate
does not skew the 10% split.

Each resident block has a counter, +1 per access, capped at 3.

Evicting (``victim``): from S while S holds at least its 10% share (or M
is empty), else from M.
- From S, the oldest block moves to M if it was accessed at least once
  (counter cleared on the move, as in the paper's text), else it is the
  victim and its hash enters G.
- From M, the oldest block with counter > 0 is re-queued at the tail with
  counter - 1 (lazy promotion); the first with counter 0 is the victim.

The store decides when to evict, so M may grow past its share while S
shrinks; the choice above then drains M until S is back at its share.
Pinned blocks met on the way are handled as if they had been read: in S
they move on to M (so a small S full of pinned blocks is not walked again
on every call), in M they are re-queued at the tail with their counter
unchanged.
"""
from __future__ import annotations

from collections import OrderedDict

from cache_service.store.eviction.base import EvictionPolicy, PinnedFn
from tiers.types import BlockHash

MAX_FREQ = 3  # two bits per block, as in the paper
SMALL_FRACTION = 0.1


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with a small FIFO (~10%), a main FIFO and a ghost FIFO."""

    name = "s3fifo"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        # OrderedDicts used as FIFOs with O(1) membership: front = oldest.
        self._small: OrderedDict[BlockHash, None] = OrderedDict()
        self._main: OrderedDict[BlockHash, None] = OrderedDict()
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self._freq: dict[BlockHash, int] = {}

    @property
    def small_target(self) -> int:
        """S's share: ~10% of the cache, at least one block."""
        return max(1, round(SMALL_FRACTION * self.effective_capacity))

    @property
    def ghost_capacity(self) -> int:
        """G remembers as many hashes as M's share of the cache."""
        return max(1, self.effective_capacity - self.small_target)

    def insert(self, h: BlockHash) -> None:
        if h in self._freq:
            self.touch(h)
            return
        self._freq[h] = 0
        if h in self._ghost:
            # Evicted recently and wanted again: it skips the probation queue.
            del self._ghost[h]
            self._main[h] = None
        else:
            self._small[h] = None
        self._note_size()

    def touch(self, h: BlockHash) -> None:
        f = self._freq.get(h)
        if f is not None and f < MAX_FREQ:
            self._freq[h] = f + 1

    def remove(self, h: BlockHash) -> None:
        if self._freq.pop(h, None) is not None:
            self._small.pop(h, None)
            self._main.pop(h, None)

    def victim(self, pinned: PinnedFn) -> BlockHash | None:
        order = (self._evict_small, self._evict_main)
        if len(self._small) < self.small_target and self._main:
            # main again last: a pass over S moves its read (or pinned) blocks into M, evictable there now
            order = (self._evict_main, self._evict_small, self._evict_main)
        for evict in order:
            h = evict(pinned)
            if h is not None:
                return h
        return None

    def _evict_small(self, pinned: PinnedFn) -> BlockHash | None:
        small = self._small
        # Every block examined leaves S: promoted, or evicted.
        while small:
            h = next(iter(small))
            if self._freq[h] > 0 or pinned(h):
                del small[h]
                self._main[h] = None
                self._freq[h] = 0
                continue
            del small[h]
            del self._freq[h]
            self._remember(h)
            return h
        return None

    def _evict_main(self, pinned: PinnedFn) -> BlockHash | None:
        main, pinned_run = self._main, 0
        # Counters only go down, so an unpinned block reaches 0 within
        # MAX_FREQ passes; a full run of pinned blocks means all are pinned.
        while main and pinned_run < len(main):
            h = next(iter(main))
            if pinned(h):
                main.move_to_end(h)
                pinned_run += 1
                continue
            pinned_run = 0
            if self._freq[h] > 0:
                self._freq[h] -= 1
                main.move_to_end(h)
                continue
            del main[h]
            del self._freq[h]
            return h
        return None

    def _remember(self, h: BlockHash) -> None:
        self._ghost[h] = None
        if len(self._ghost) > self.ghost_capacity:
            self._ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, h: object) -> bool:
        return h in self._freq

    def ghost_count(self) -> int:
        return len(self._ghost)

    def queue_of(self, h: BlockHash) -> str | None:
        """Which queue holds ``h``: "small", "main", "ghost" or None (for stats and tests)."""
        for label, q in (("small", self._small), ("main", self._main), ("ghost", self._ghost)):
            if h in q:
                return label
        return None

    def _check(self) -> None:
        """Internal consistency of the queues (used by tests)."""
        assert not (self._small.keys() & self._main.keys())
        assert not (self._ghost.keys() & self._freq.keys())
        assert len(self._small) + len(self._main) == len(self._freq)
        assert all(0 <= f <= MAX_FREQ for f in self._freq.values())
        assert len(self._ghost) <= self.ghost_capacity <= self.capacity_blocks
