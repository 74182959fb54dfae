"""The eviction-policy interface the store drives, one instance per tier.

The store decides *when* to evict (its tier is full) and asks the policy
*which* block goes. The policy only tracks block hashes; it never touches a
tier. Policies are not thread-safe: the store calls them under its lock.

Call protocol (all hashes are ``BlockHash``):

- ``insert(h)``: ``h`` is now resident in the tier. Inserting a hash that is
  already resident counts as an access (same as ``touch``).
- ``touch(h)``: ``h`` was read while resident; a no-op when it is not.
- ``remove(h)``: ``h`` left the tier for a reason other than eviction
  (delete, corruption); a no-op when it is not resident.
- ``victim(pinned)``: pick the next block to evict, skipping every block for
  which ``pinned(h)`` is true, forget it and return it; ``None`` when no
  unpinned block is resident. Each call asks ``pinned`` about at most a
  small multiple of the resident count, so it always terminates.

A pinned block that ``victim`` passes over is treated as if it had just
been used (LRU: most recent; LFU: one more access; S3-FIFO: on to the main
queue; ARC: to T2), so a later call does not walk over it again: with few
pins each call is amortized O(1), and with many it costs about
pinned / unpinned blocks, not the whole resident set.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Sequence

from tiers.types import BlockHash, ConfigError

PinnedFn = Callable[[BlockHash], bool]


def _unpinned(h: BlockHash) -> bool:
    return False


class EvictionPolicy(ABC):
    """Chooses eviction victims among a tier's resident blocks.

    ``capacity_blocks`` is how many blocks the tier holds when full; it may
    be an estimate (block size depends on the model). Policies that size
    queues or history from it (LFU's aging period, S3-FIFO, ARC) use
    ``effective_capacity`` instead, and ghost (history) entries never
    exceed it.
    """

    name: ClassVar[str]
    # True: the store inserts every key a tier holds at open (the policy mirrors
    # them); False: the policy reads the tier's own records (built with source=tier)
    rebuilt_from_keys: ClassVar[bool] = True

    def __init__(self, capacity_blocks: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
            raise ConfigError(f"eviction capacity_blocks must be a positive int, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._peak = 0  # most blocks resident at once so far

    @property
    def effective_capacity(self) -> int:
        """``min(capacity_blocks, most blocks ever resident at once)``, >= 1.

        The store evicts only when its tier is full, so once the tier has
        filled, the peak is its real size in blocks even when
        ``capacity_blocks`` over-estimates it. It never decreases.
        """
        return max(1, min(self.capacity_blocks, self._peak))

    def _note_size(self) -> None:
        """Record the resident count after a block was added."""
        n = len(self)
        if n > self._peak:
            self._peak = n

    @abstractmethod
    def insert(self, h: BlockHash) -> None:
        """Block ``h`` is now resident (new, or re-inserted after leaving)."""

    def insert_many(self, hashes: Sequence[BlockHash]) -> None:
        """`insert` of each, in order (a policy may do a batch in one step)."""
        for h in hashes:
            self.insert(h)

    @abstractmethod
    def touch(self, h: BlockHash) -> None:
        """Block ``h`` was hit while resident; ignored when not resident."""

    @abstractmethod
    def remove(self, h: BlockHash) -> None:
        """Block ``h`` left the tier without being evicted; no-op if absent."""

    @abstractmethod
    def victim(self, pinned: PinnedFn) -> BlockHash | None:
        """Remove and return the next unpinned block to evict, or None."""

    def victims(self, n: int, pinned: PinnedFn | None = None) -> list[BlockHash]:
        """Up to `n` victims in eviction order, each removed as by `victim`
        (fewer when only pinned blocks are left; `pinned` None: none is)."""
        out: list[BlockHash] = []
        while len(out) < n and (v := self.victim(pinned or _unpinned)) is not None:
            out.append(v)
        return out

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks tracked."""

    @abstractmethod
    def __contains__(self, h: object) -> bool:
        """Whether ``h`` is resident (ghost entries do not count)."""

    def ghost_count(self) -> int:
        """Non-resident history entries kept (at most ``capacity_blocks``)."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity_blocks={self.capacity_blocks}, resident={len(self)})"
