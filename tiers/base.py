"""The `Tier` interface: one storage level of the hierarchy.

A tier stores opaque *block objects* (1-D contiguous ``torch.uint8`` tensors:
header + payload, see ``cache_service/objects.py``) under their BlockHash.
A tier never evicts by itself and never knows another tier: the store picks
victims with its eviction policy, deletes them here and demotes them below.
All operations are batched: one call per request, not per block.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from tiers.counters import Counters
from tiers.types import BlockHash


@dataclass(slots=True)
class TierStats(Counters):
    """Counters of one tier; the store adds hits/misses/evictions/corrupt."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    blocks: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


class Tier(ABC):
    """One level of the hierarchy (HBM, CPU, disk, S3).

    ``verify_payload`` tells the store whether objects read from this tier need
    their payload checksum checked (memory tiers are trusted; a tier that
    verifies its own stored checksum may say False too).
    """

    name: str = "tier"
    verify_payload: bool = True

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0, "tier capacity must be positive"
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats(capacity_bytes=capacity_bytes)

    @abstractmethod
    def put_many(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor]) -> list[bool]:
        """Store each object; True where it is now held (already held counts).

        Raises CapacityError for an object that can never fit. Returns False
        where there is no free space right now (the store evicts first).
        """

    @abstractmethod
    def get_many(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Objects for each hash (None for a miss). Returned tensors are the
        caller's: a later eviction never changes them."""

    @abstractmethod
    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each block is fully held."""

    @abstractmethod
    def delete_many(self, hashes: Iterable[BlockHash]) -> int:
        """Remove blocks; returns how many were present."""

    @abstractmethod
    def keys(self) -> list[BlockHash]:
        """Every block held (used to rebuild eviction state on open)."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Room left for new objects, in bytes (slot-granular for pools)."""

    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity an object of `nbytes` would consume here."""
        return nbytes

    def note_namespace(self, fingerprint: bytes) -> None:
        """The store is about to load blocks of this namespace (a tier whose
        keys include it, like S3's, uses the hint to find blocks it never saw)."""

    def quarantine(self, hashes: Iterable[BlockHash]) -> None:
        """Take objects that failed verification out of service (a tier that
        can keep them aside for inspection overrides this)."""
        self.delete_many(hashes)

    def close(self) -> None:
        """Release resources; the tier is unusable afterwards."""
