"""The `Tier` interface: one storage level of the hierarchy.

A tier stores opaque *block objects* (1-D contiguous ``torch.uint8`` tensors:
header + payload, see ``cache_service/blocks/objects.py``) under their BlockHash.
A tier never evicts by itself and never knows another tier: the store picks
victims with its eviction policy, deletes them here and demotes them below.
All operations are batched: one call per request, not per block.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from tiers.counters import Counters
from tiers.types import BlockHash, CapacityError, TierKVError


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
    recovering: int = 0  # 1 while a disk tier indexes again the blocks written before an unclean stop
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


class Tier(ABC):
    """One level of the hierarchy (HBM, CPU, disk, S3).

    ``verify_payload`` tells the store whether objects read from this tier need
    their payload checksum checked (memory tiers are trusted; a tier that
    verifies its own stored checksum may say False too). ``remote`` marks a
    tier read over the network: the store copies its hits up on the first one.
    ``rechecks`` marks a tier whose stored copies can be damaged while it
    runs or sleeps (files): the store has it `recheck` a copy it holds when
    the same block is stored again, since a block recomputed by an engine
    while a copy exists may mean that copy is bad. ``keeps_recency`` marks a
    tier that records its blocks' last access itself and answers `oldest`.
    """

    name: str = "tier"
    keeps_recency: bool = False
    verify_payload: bool = True
    remote: bool = False
    rechecks: bool = False

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0, "tier capacity must be positive"
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats(capacity_bytes=capacity_bytes)

    def available(self) -> bool:
        """False while the tier refuses writes for a reason that passes (its
        server down); the store retries what it refused then. Cheap, no I/O."""
        return True

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

    def oldest(self, n: int, draws: int, skip: Callable[[BlockHash], bool] = lambda h: False) -> list[BlockHash]:
        """Up to n held blocks not in `skip`, least recently used first (a
        tier that `keeps_recency` finds them in its own records, exactly or
        among `draws` random ones; the store's "sampled" policy asks)."""
        raise TierKVError(f"the {self.name} tier keeps no access times")

    def note_namespace(self, fingerprint: bytes, object_bytes: int = 0) -> None:
        """The store is about to load blocks of this namespace, objects of
        `object_bytes` each (a tier whose keys include it, like S3's, uses the
        hint to find blocks it never saw, and reads no object of another size)."""

    def take_gone(self) -> list[BlockHash]:
        """Blocks reads found missing from where others may think them (a
        shared bucket: expired, or deleted by another node) since the last
        call, for the store to take out of the directory. Others: []."""
        return []

    def recheck(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Of held `hashes`, those whose stored copy is damaged (taken out of
        service now, so they can be written again). Tiers that trust their
        copies return []."""
        return []

    def quarantine(self, hashes: Iterable[BlockHash]) -> None:
        """Take objects that failed verification out of service (a tier that
        can keep them aside for inspection overrides this)."""
        self.delete_many(hashes)

    def tick(self) -> None:
        """Work of the tier's own, on its writer's thread about once a second
        while it is available (S3: deletes it could not send before)."""

    def close(self) -> None:
        """Release resources; the tier is unusable afterwards."""


class ByteBudget:
    """Capacity in bytes for tiers whose objects each take their own size
    (disk, S3). The tier provides `_lock`, `_index` (held hashes) or `_present`, `_used`,
    `_reserved` (bytes of puts in progress) and `_check_open()`."""

    def footprint(self, nbytes: int) -> int:
        if nbytes > self.capacity_bytes:
            raise CapacityError(f"{self.name}: object of {nbytes} B exceeds capacity {self.capacity_bytes} B")
        return nbytes

    def free_bytes(self) -> int:
        with self._lock:
            return max(0, self.capacity_bytes - self._used - self._reserved)

    def _present(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each block is held now (a tier without an `_index` overrides this)."""
        with self._lock:
            return [h in self._index for h in hashes]

    def _admit(self, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor],
               sizes: Sequence[int] | None = None) -> list[int]:
        """Indices of the objects to write now: new, first of their hash in
        the batch, and within capacity; their bytes are reserved (the caller
        releases the reservation when the writes end). `sizes`: their
        `numel`s, where the caller has them."""
        assert len(hashes) == len(objs), "one object per hash"
        assert all(o.dtype == torch.uint8 and o.dim() == 1 and o.is_contiguous() for o in objs), \
            "objects are 1-D contiguous uint8 tensors"
        sizes = [obj.numel() for obj in objs] if sizes is None else sizes
        if sizes:
            self.footprint(max(sizes))  # one that can never fit refuses the batch
        todo: list[int] = []
        held = self._present(hashes)  # racy, and so are puts: the tier's commit checks again
        with self._lock:
            self._check_open()
            seen: set[BlockHash] = set()
            room = self.capacity_bytes - self._used - self._reserved
            for i, (h, size) in enumerate(zip(hashes, sizes)):
                if h in seen or held[i]:
                    continue
                seen.add(h)
                if size <= room:
                    room -= size
                    todo.append(i)
            self._reserved = self.capacity_bytes - self._used - room
        return todo


class SlotTier(Tier):
    """A tier of fixed-size slots in memory (`tiers.cpu.SlotPool`): what the
    store may ask of it beyond `Tier`.

    ``get_into`` copies hits straight into the caller's buffers (the
    allocation-free load). A ``shared`` pool lives in memory another process
    maps (``share_fd``: its memfd; ``rows``: the pool as ``[num_slots,
    slot_bytes]``, rows ``slot_stride`` bytes apart): that process writes
    objects into slots the store ``reserve``s for it, and the store
    ``publish``es them, or hands them back (``unreserve``).
    """

    shared: bool = False
    num_slots: int = 0
    slot_bytes: int = 0
    slot_stride: int = 0
    share_fd: int = -1

    @abstractmethod
    def get_into(self, hashes: Sequence[BlockHash], outs: Sequence[torch.Tensor],
                 hash_from: int | None = None) -> list:
        """Copy each held object into the prefix of `outs[j]`; False per miss
        (None with `hash_from`: then a hit's entry is its bytes' xxh3_64 from
        that offset on, else True)."""

    @abstractmethod
    def reserve(self, hashes: Sequence[BlockHash], nbytes: int) -> list[int | None]:
        """A free slot per hash not held (None: held, repeated or no room),
        for an object of `nbytes` someone else writes."""

    @abstractmethod
    def reserve_free(self, n: int, nbytes: int) -> list[int]:
        """Up to n free slots for objects of `nbytes` not yet for any block."""

    @abstractmethod
    def publish(self, hashes: Sequence[BlockHash], slots: Sequence[int], nbytes: int) -> list[bool]:
        """Make reserved, written slots the objects of `hashes`; False where a racing put won."""

    @abstractmethod
    def unreserve(self, slots: Iterable[int]) -> None:
        """Hand reserved slots back unwritten."""

    @abstractmethod
    def hold(self, hashes: Sequence[BlockHash]) -> list[tuple[int, torch.Tensor] | None]:
        """(slot, view of the object) per held hash (None: not held), each slot
        kept from reuse, even once its block is evicted or deleted, until
        `let_go`: a reader of the view (a write to a lower tier) needs no copy."""

    @abstractmethod
    def let_go(self, held: Sequence[tuple[int, torch.Tensor] | None]) -> None:
        """End `hold`s: a slot whose block left meanwhile becomes free."""

    @property
    @abstractmethod
    def rows(self) -> torch.Tensor:
        """The pool as one ``[num_slots, slot_bytes]`` tensor."""
