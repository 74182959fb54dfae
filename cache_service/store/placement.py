"""How blocks move between a TieredStore's tiers: puts with eviction, victims
sent down, background writers, promotion of hits (mixed into `TieredStore`,
whose attributes it uses: tiers, policies, modes, cfg, the per-tier locks,
the in-flight map and the writers).

Locks: a tier's lock guards its membership and policy while a put evicts
and places; writers hold objects in the in-flight map (under ``_meta``)
until they land, so a block stays visible while it moves down.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

import torch

from cache_service.store.writer import Item
from tiers.base import Tier
from tiers.types import BlockHash, CapacityError

_MAX_BELOW_HITS = 1 << 16  # blocks whose lower-tier hits are remembered (oldest forgotten first)
_MAX_DEFERRED = 1 << 20  # blocks a down tier refused, remembered to write once it is back


class BlockMoves:
    """The store's placement machinery (see the module docstring)."""

    _below_hits: OrderedDict[BlockHash, int]
    _deferred: list[OrderedDict[BlockHash, None]]

    def _put(self, i: int, items: Sequence[Item], owned: bool = True, retry: bool = False) -> set[BlockHash]:
        """Put items into tier i, evicting as needed; victims and items that
        cannot fit go down (copied first unless `owned`: the caller's buffers
        may be reused), or are deferred while tier i is down (always when
        `retry`: they were deferred before). Returns the hashes now held by tier i."""
        tier, pol = self.tiers[i], self.policies[i]
        victims: list[Item] = []
        with self._locks[i]:
            todo = [it for it, ok in zip(items, tier.contains_many([h for h, _ in items])) if not ok]
            ok = self._put_locked(i, todo, victims)
            for (h, _), good in zip(todo, ok):
                if good:
                    pol.insert(h)
        self._publish(i, [h for (h, _), good in zip(todo, ok) if good])
        held = {h for h, _ in items} - {h for (h, _), good in zip(todo, ok) if not good}
        self._evicted(i, victims)
        bypassed = [it for it, good in zip(todo, ok) if not good]
        if i and bypassed and (retry or not tier.available()):  # down for now: written once it is back
            self._defer(i, [h for h, _ in bypassed])
            bypassed = []
        if not owned and i + 1 < len(self.tiers):
            bypassed = [(h, obj.clone()) for h, obj in bypassed]
        self._demote(i, bypassed, "bypassed")
        return held

    def _defer(self, i: int, hashes: Sequence[BlockHash]) -> None:
        """Remember blocks tier i refused while down (hashes only: their bytes
        stay in the tiers above); bounded, the oldest are dropped first."""
        with self._meta:
            later = self._deferred[i]
            later.update(dict.fromkeys(hashes))
            over = max(0, len(later) - _MAX_DEFERRED)
            for _ in range(over):
                later.popitem(last=False)
        self._count(i, deferred=len(hashes), dropped=over)

    def _retry_deferred(self, i: int, batch: int = 64, most: int = 4096) -> None:
        """Writer i's tick: once tier i is available again, write the blocks it
        refused while down, read back from the tiers above (a block that left
        them meanwhile is dropped and counted; one refused again is deferred
        again, and the tick ends)."""
        done = 0
        while done < most and self.tiers[i].available():
            with self._meta:
                hs = [self._deferred[i].popitem(last=False)[0] for _ in range(min(batch, len(self._deferred[i])))]
            if not hs:
                return
            items = self._read_above(i, hs)
            self._count(i, dropped=len(hs) - len(items))
            if len(self._put(i, items, retry=True)) < len(items):
                return  # refused again (a service still coming back, say): kept for a later tick
            done += len(hs)

    def _read_above(self, i: int, hashes: Sequence[BlockHash]) -> list[Item]:
        """(hash, object) of each of `hashes` some tier above i holds."""
        found: dict[BlockHash, torch.Tensor] = {}
        for tier in self.tiers[:i]:
            todo = [h for h in hashes if h not in found]
            if not todo:
                break
            found.update((h, obj) for h, obj in zip(todo, tier.get_many(todo)) if obj is not None)
        return [(h, found[h]) for h in hashes if h in found]

    def _put_locked(self, i: int, todo: Sequence[Item], victims: list[Item]) -> list[bool]:
        tier = self.tiers[i]
        try:
            need = sum(tier.footprint(obj.numel()) for _, obj in todo)
        except CapacityError:
            return [False] * len(todo)
        self._make_room(i, need, victims)
        try:
            return tier.put_many([h for h, _ in todo], [obj for _, obj in todo])
        except CapacityError:  # one object can never fit: place the others one by one
            return [self._put_one(tier, it) for it in todo]

    def _make_room(self, i: int, need: int, victims: list[Item]) -> None:
        """Evict from tier i (caller holds its lock) until `need` bytes are free
        or only pinned blocks are left; each victim, with its object when a
        tier below can take it, goes into `victims` (see `_evicted`)."""
        tier = self.tiers[i]
        while (short := need - tier.free_bytes()) > 0:
            # as many victims as the tier's average block frees that much: one batched read and delete
            used, blocks = tier.stats.used_bytes, tier.stats.blocks
            picked = []
            for _ in range(-(-short // max(1, used // blocks)) if blocks else 1):
                v = self.policies[i].victim(self._is_pinned)
                if v is None:
                    break
                picked.append(v)
            if not picked:
                break
            objs = tier.get_many(picked) if i + 1 < len(self.tiers) else [None] * len(picked)
            tier.delete_many(picked)
            self._publish(i, picked, present=False)
            victims.extend(zip(picked, objs))  # counted as evictions even with nowhere to go

    def _evicted(self, i: int, victims: Sequence[Item]) -> None:
        """Count `_make_room`'s victims and send them down (outside the tier's lock)."""
        self._count(i, evictions=len(victims))
        self._demote(i, [v for v in victims if v[1] is not None], "demoted")

    @staticmethod
    def _put_one(tier: Tier, item: Item) -> bool:
        try:
            return tier.put_many([item[0]], [item[1]])[0]
        except CapacityError:
            return False

    def _demote(self, i: int, items: Sequence[Item], counter: str) -> None:
        """Send items evicted from (or not fitting in) tier i to tier i + 1."""
        if not items:
            return
        if i + 1 >= len(self.tiers):
            self._count(i, dropped=len(items) if counter == "bypassed" else 0)
            return
        todo = [it for it in items if not self._below_has(i + 1, it[0])]
        self._count(i, **{counter: len(todo)})
        self._submit(i + 1, todo)

    def _below_has(self, i: int, h: BlockHash) -> bool:
        return self.tiers[i].contains_many([h])[0]

    def _submit(self, i: int, items: Sequence[Item], wait: bool | None = None) -> None:
        writer = self._writers[i]
        wait = self.cfg.queue_full == "wait" if wait is None else wait
        for h, obj in items:
            with self._meta:
                entry = self._inflight.setdefault(h, [obj, 0])
                entry[1] += 1
            if not writer.submit((h, obj), wait):
                self._release([h])
                self._count(i, dropped=1)

    def _release(self, hashes: Iterable[BlockHash]) -> None:
        with self._meta:
            for h in hashes:
                entry = self._inflight.get(h)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._inflight[h]

    def _persist(self, i: int, batch: Sequence[Item]) -> None:
        """Writer-thread body for tier i: put a batch, demoting victims below
        (tier 0's writer carries promotions, which it counts)."""
        with self._meta:  # a block deleted while queued must not come back
            live = [it for it in batch if it[0] in self._inflight]
        try:
            held = self._put(i, live)
            if i == 0:
                self._count(0, promoted=len(held))
        finally:
            self._release(h for h, _ in batch)

    def _due(self, i: int, h: BlockHash) -> bool:
        """Count a hit of `h` in tier i > 0; True when it is the one that promotes."""
        n = self.cfg.promote_after_hits
        if n <= 1 or self.tiers[i].remote:
            return n >= 1
        with self._meta:
            seen = self._below_hits.pop(h, 0) + 1
            if seen < n:
                self._below_hits[h] = seen
                if len(self._below_hits) > _MAX_BELOW_HITS:
                    self._below_hits.popitem(last=False)
        return seen >= n

    def _promote(self, hits: Sequence[tuple[int, BlockHash, torch.Tensor]]) -> None:
        """Hits from tier i go into tiers 0..i-1 in the background, so a load
        never waits on a copy into another tier. A full promotion queue drops
        them (the block is still where it was found)."""
        for i in range(len(self.tiers) - 1, 0, -1):
            items = [(h, obj) for k, h, obj in hits if k == i]
            if not items:
                continue
            self._submit(0, items, wait=False)
            for up in range(1, i):
                self._submit(up, items)
