"""The state a TieredStore's parts share (`TieredStore`, `Placement`,
`SharedSlots`), declared in one place, with the small helpers that only
touch it: counters, recency, directory announcements.

Locks: ``locks[i]`` guards tier i's membership and its policy (taken top to
bottom when more than one is held); ``meta`` guards the in-flight map, the
counters, the remembered lower-tier hits, the deferred blocks and
the count of spare slots out. No I/O happens under ``meta``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from cache_service.config import StoreConfig
from cache_service.store.deletes import DeleteLog
from cache_service.store.eviction.base import EvictionPolicy
from cache_service.store.pins import PinBook
from tiers.base import Tier
from tiers.types import BlockHash

if TYPE_CHECKING:
    from cache_service.directory.redis_directory import RedisDirectory
    from cache_service.store.journal import UploadJournal
    from cache_service.store.writer import TierWriter

COUNTERS = ("hits", "misses", "evictions", "corrupt", "promoted", "demoted", "dropped", "bypassed", "deferred", "lost")


@dataclass(slots=True)
class StoreState:
    """Tiers top (fastest) to bottom, each with its policy and write mode, and
    what the store keeps about them (module docstring for the locks)."""

    tiers: list[Tier]
    policies: list[EvictionPolicy]
    modes: list[str]  # per tier: "through" (every new block) or "back" (blocks evicted from above)
    cfg: StoreConfig
    directory: "RedisDirectory | None" = None
    where: list[str | None] = field(init=False)  # directory location per tier (None: only this node sees it)
    locks: list[threading.RLock] = field(init=False)
    meta: threading.Lock = field(default_factory=threading.Lock)
    inflight: dict[BlockHash, dict[int, list]] = field(default_factory=dict)  # hash -> id(obj) -> [obj, writes queued]
    pins: PinBook = field(init=False)  # its own lock (a leaf: taken under meta and tier locks alike)
    below_hits: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)  # lower-tier hits not yet promoted
    deferred: list[OrderedDict[BlockHash, None]] = field(init=False)  # per tier: blocks refused while it was down
    counters: list[dict[str, int]] = field(init=False)
    # writer 0 promotes hits into the top tier; writer i > 0 fills tier i (set by the store once built)
    writers: list["TierWriter"] = field(default_factory=list)
    deletes: DeleteLog = field(default_factory=DeleteLog)  # its own lock (a leaf, like the pins')
    spares_out: int = 0  # spare slots handed out and not yet committed or handed back
    # per tier: its upload journal (journal.py) or None; the deferred set then holds only what the journal refused
    journals: list["UploadJournal | None"] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.tiers and len(self.tiers) == len(self.policies) == len(self.modes)
        d = self.directory
        self.where = [d.location_of(t.name) if d else None for t in self.tiers]
        self.locks = [threading.RLock() for _ in self.tiers]
        self.deferred = [OrderedDict() for _ in self.tiers]
        self.counters = [dict.fromkeys(COUNTERS, 0) for _ in self.tiers]
        self.pins = PinBook(self.cfg.tenant_pin_bytes, self.typical_block_bytes)
        self.journals = self.journals or [None] * len(self.tiers)
        assert len(self.journals) == len(self.tiers)

    def typical_block_bytes(self) -> int:
        """What a block takes in the top tier now (its average; 0 when empty)."""
        stats = self.tiers[0].stats
        return stats.used_bytes // stats.blocks if stats.blocks > 0 else 0

    def through(self) -> list[int]:
        """Indexes of the write-through tiers below the top (they get a copy of every new block)."""
        return [i for i in range(1, len(self.tiers)) if self.modes[i] == "through"]

    def count(self, i: int, **deltas: int) -> None:
        """Add to tier i's store counters."""
        with self.meta:
            c = self.counters[i]
            for k, v in deltas.items():
                c[k] += v

    def stats(self) -> dict[str, dict[str, int]]:
        """`TieredStore.stats`."""
        out = {}
        for i, tier in enumerate(self.tiers):
            with self.meta:
                c = dict(self.counters[i])
            t = tier.stats.as_dict()
            c["corrupt"] += t["corrupt"]  # the tier's own checksum failures plus the store's
            t.update(c)
            t["queue_depth"] = self.writers[i].depth()
            if self.journals[i] is not None:
                t.update(self.journals[i].stats())
            out[tier.name] = t
        return out

    def touch(self, i: int, hashes: Sequence[BlockHash]) -> None:
        """Refresh the recency of blocks tier i holds."""
        if hashes:
            with self.locks[i]:
                for h in hashes:
                    self.policies[i].touch(h)

    def publish(self, i: int, hashes: Sequence[BlockHash], present: bool = True) -> None:
        """Tell the directory (queued, no I/O here) that tier i now holds, or
        no longer holds, these blocks; a no-op for tiers only this node sees."""
        where = self.where[i]
        if where is not None and hashes:
            (self.directory.publish if present else self.directory.unpublish)(where, hashes)

    def announce(self, redis_was_empty: bool) -> None:
        """Directory callback on (re)registration: re-publish this node's
        disk; after Redis lost its data, the S3 blocks this node knows too."""
        for i, tier in enumerate(self.tiers):  # paced by the directory; most recently used first
            if self.where[i] is not None and (tier.name != "s3" or redis_was_empty):
                self.directory.announce(self.where[i], tier.keys()[::-1])
