"""How blocks move between a TieredStore's tiers: puts with eviction, victims
sent down, background writers, promotion of hits. `Placement` works on the
store's `StoreState` (cache_service/store/state.py), which it shares with
the store and with `SharedSlots`.

Locks: a tier's lock guards its membership and policy while a put evicts
and places; writers hold objects in the in-flight map (under ``meta``)
until they land, so a block stays visible while it moves down. The map
counts each queued object apart (by identity): a delete drops every write
of its blocks queued so far, and a write that ends later cannot end one
queued since (nor a slot hold taken for it, `keep`).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

import torch

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import decode, intact
from cache_service.store.state import StoreState
from cache_service.store.writer import Item
from tiers.base import Tier
from tiers.types import BlockHash, CapacityError, CorruptBlockError

log = logging.getLogger("tierkv.store")
_MAX_BELOW_HITS = 1 << 16  # blocks whose lower-tier hits are remembered (oldest forgotten first)
_MAX_DEFERRED = 1 << 20  # blocks a down tier refused, remembered to write once it is back


class Placement:
    """The store's placement machinery (see the module docstring)."""

    def __init__(self, state: StoreState) -> None:
        self.state = state

    def put(self, i: int, items: Sequence[Item], owned: bool = True, retry: bool = False,
            queued: bool = False) -> set[BlockHash]:
        """Put items into tier i, evicting as needed; victims and items that
        cannot fit go down (copied first unless `owned`: the caller's buffers
        may be reused), or are deferred while tier i is down (always when
        `retry`: they were deferred before). `queued`: the items are a
        writer's, put only while still in flight (under the tier's lock, so
        a delete that ran first wins). Returns the hashes now held by tier i."""
        tier, pol = self.state.tiers[i], self.state.policies[i]
        victims: list[Item] = []
        with self.state.locks[i]:
            if queued:
                items = self._live(items)
            todo = [it for it, ok in zip(items, self._holds(i, [h for h, _ in items])) if not ok]
            ok = self._put_locked(i, todo, victims)
            pol.insert_many([h for (h, _), good in zip(todo, ok) if good])
        self.state.publish(i, [h for (h, _), good in zip(todo, ok) if good])
        held = {h for h, _ in items} - {h for (h, _), good in zip(todo, ok) if not good}
        self.evicted(i, victims)
        bypassed = [it for it, good in zip(todo, ok) if not good]
        if i and bypassed and (retry or not tier.available()):  # down for now: written once it is back
            self._defer(i, bypassed)
            bypassed = []
        if not owned and i + 1 < len(self.state.tiers):
            bypassed = [(h, obj.clone()) for h, obj in bypassed]
        self.demote(i, bypassed, "bypassed")
        return held

    def _holds(self, i: int, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether tier i holds each block sound: a tier that `rechecks` reads
        back the copies it has of blocks stored again (caller holds its lock)."""
        tier = self.state.tiers[i]
        held = tier.contains_many(hashes)
        if tier.rechecks and any(held):
            bad = set(tier.recheck([h for h, ok in zip(hashes, held) if ok]))
            if bad:
                for h in bad:
                    self.state.policies[i].remove(h)
                self.state.publish(i, list(bad), present=False)
                held = [ok and h not in bad for h, ok in zip(hashes, held)]
        return held

    def _defer(self, i: int, items: Sequence[Item]) -> None:
        """Remember blocks tier i refused while down: in its upload journal
        (durable, with their bytes) when it has one, else, or past the
        journal's bound, their hashes in memory (their bytes stay in the
        tiers above); that set is bounded, the oldest dropped first."""
        journal = self.state.journals[i]
        kept = set(journal.record(items)) if journal is not None else set()
        with self.state.meta:
            later = self.state.deferred[i]
            later.update(dict.fromkeys(h for h, _ in items if h not in kept))
            over = max(0, len(later) - _MAX_DEFERRED)
            for _ in range(over):
                later.popitem(last=False)
        self.state.count(i, deferred=len(items), dropped=over)

    def retry_deferred(self, i: int, batch: int = 64, most: int = 4096) -> bool:
        """Writer i's tick: once tier i is available again, write the blocks it
        refused while down: its journal's oldest first, then those remembered
        in memory, read back from the tiers above (one that left them
        meanwhile is lost, counted and logged; one refused again is
        deferred again, and the tick ends). Live writes are not starved: once
        a batch is done and new work waits in the writer's queue, the tick
        ends and returns True (more to do: tick again after the next live
        batch), so an outage's backlog and the live stores behind it take turns."""
        done, journal = 0, self.state.journals[i]
        while done < most and self.state.tiers[i].available():
            if done and self.state.writers[i].depth():
                return bool(self.state.deferred[i]) or bool(journal and len(journal))
            items = self._next_deferred(i, batch)
            if items is None:
                return False
            held = self.put(i, items, retry=True)
            if journal is not None:
                journal.forget(list(held))
            if len(held) < len(items):
                return False  # refused again (a service still coming back, say): kept for a later tick
            done += max(1, len(items))
        return False

    def _next_deferred(self, i: int, batch: int) -> list[Item] | None:
        """The next batch to retry for tier i (None: nothing is waiting)."""
        journal = self.state.journals[i]
        if journal is not None and (hs := journal.oldest(batch)):
            items, missing = journal.read(hs)
            journal.forget(missing)  # gone from its file: not to be retried forever
            self._lost(i, len(missing))
            return items if items or missing else None  # nothing read (a failing read): the next tick tries again
        later = self.state.deferred[i]
        with self.state.meta:
            hs = [later.popitem(last=False)[0] for _ in range(min(batch, len(later)))]
        if not hs:
            return None
        items = self._read_above(i, hs)
        self._lost(i, len(hs) - len(items))
        return items

    def _lost(self, i: int, n: int) -> None:
        """n blocks bound for tier i can no longer reach it (no copy left to send)."""
        if n:
            self.state.count(i, lost=n)
            log.warning("%d blocks bound for tier %s were lost (no copy left to write)", n, self.state.tiers[i].name)

    def _read_above(self, i: int, hashes: Sequence[BlockHash]) -> list[Item]:
        """(hash, object) of each of `hashes` some tier above i holds."""
        found: dict[BlockHash, torch.Tensor] = {}
        for tier in self.state.tiers[:i]:
            todo = [h for h in hashes if h not in found]
            if not todo:
                break
            found.update((h, obj) for h, obj in zip(todo, tier.get_many(todo)) if obj is not None)
        return [(h, found[h]) for h in hashes if h in found]

    def _put_locked(self, i: int, todo: Sequence[Item], victims: list[Item]) -> list[bool]:
        tier = self.state.tiers[i]
        try:
            need = sum(tier.footprint(obj.numel()) for _, obj in todo)
        except CapacityError:
            return [False] * len(todo)
        self.make_room(i, need, victims)
        try:
            return tier.put_many([h for h, _ in todo], [obj for _, obj in todo])
        except CapacityError:  # one object can never fit: place the others one by one
            return [self._put_one(tier, it) for it in todo]

    def make_room(self, i: int, need: int, victims: list[Item]) -> None:
        """Evict from tier i (caller holds its lock) until `need` bytes are free
        or only pinned blocks are left; each victim, with its object when a
        tier below can take it, goes into `victims` (see `evicted`)."""
        tier = self.state.tiers[i]
        while (short := need - tier.free_bytes()) > 0:
            # as many victims as the tier's average block frees that much: one batched read and delete
            used, blocks = tier.stats.used_bytes, tier.stats.blocks
            pins = self.state.pins
            picked = self.state.policies[i].victims(-(-short // max(1, used // blocks)) if blocks else 1,
                                                    pins.is_pinned if pins.any() else None)
            if not picked:
                break
            objs = self._victim_objects(i, picked)
            self._journal_victims(i + 1, picked, objs)
            tier.delete_many(picked)
            self.state.publish(i, picked, present=False)
            victims.extend(zip(picked, objs))  # counted as evictions even with nowhere to go

    def _victim_objects(self, i: int, picked: list[BlockHash]) -> list[torch.Tensor | None]:
        """The objects of tier i's victims that must go down: those the tier
        below does not hold already (a write-through copy, the usual case,
        is not read out again); None for the others, and for all where there
        is no tier below."""
        if i + 1 >= len(self.state.tiers):
            return [None] * len(picked)
        below = self.state.tiers[i + 1].contains_many(picked)
        fetch = [h for h, ok in zip(picked, below) if not ok]
        got = dict(zip(fetch, self.state.tiers[i].get_many(fetch))) if fetch else {}
        if got and self.state.tiers[i].verify_payload and not self.state.tiers[i + 1].verify_payload:
            bad = [h for h, o in got.items() if o is not None and not intact(h, memoryview(o.contiguous().numpy()))]
            for h in bad:  # bytes a client wrote that do not match their checksum: not carried below unchecked
                log.warning("tier %s: victim %s is corrupt; dropped", self.state.tiers[i].name, h.hex())
                got[h] = None
            self.state.count(i, corrupt=len(bad))
        return [got.get(h) for h in picked]

    def _journal_victims(self, i: int, picked: Sequence[BlockHash], objs: Sequence[torch.Tensor | None]) -> None:
        """Before victims leave the tier above tier i: those tier i (a
        journaled one) does not hold yet go into its journal, so a write-back
        victim survives a crash or an outage before it lands."""
        journal = self.state.journals[i] if i < len(self.state.tiers) else None
        if journal is not None:
            journal.record([(h, o) for h, o in zip(picked, objs) if o is not None and not self.below_has(i, h)])

    def evicted(self, i: int, victims: Sequence[Item]) -> None:
        """Count `make_room`'s victims and send them down (outside the tier's lock)."""
        self.state.count(i, evictions=len(victims))
        self.demote(i, [v for v in victims if v[1] is not None], "demoted")

    @staticmethod
    def _put_one(tier: Tier, item: Item) -> bool:
        try:
            return tier.put_many([item[0]], [item[1]])[0]
        except CapacityError:
            return False

    def demote(self, i: int, items: Sequence[Item], counter: str) -> None:
        """Send items evicted from (or not fitting in) tier i to tier i + 1."""
        if not items:
            return
        if i + 1 >= len(self.state.tiers):
            self.state.count(i, dropped=len(items) if counter == "bypassed" else 0)
            return
        todo = [it for it in items if not self.below_has(i + 1, it[0])]
        self.state.count(i, **{counter: len(todo)})
        self.submit(i + 1, todo)

    def below_has(self, i: int, h: BlockHash) -> bool:
        """Whether tier i holds `h` already (no need to write it there)."""
        return self.state.tiers[i].contains_many([h])[0]

    def submit(self, i: int, items: Sequence[Item], wait: bool | None = None) -> None:
        """Queue items for writer i, in the in-flight map until they land (a
        full queue waits or drops, per ``cfg.queue_full`` unless `wait` says)."""
        st = self.state
        wait = st.cfg.queue_full == "wait" if wait is None else wait
        with st.meta:
            for h, obj in items:
                st.inflight.setdefault(h, {}).setdefault(id(obj), [obj, 0])[1] += 1
                if id(obj) in st.holds:
                    st.holds[id(obj)][0] += 1
        queued = st.writers[i].submit_many(items, wait)
        if queued < len(items):
            self._release(items[queued:])
            st.count(i, dropped=len(items) - queued)

    def keep(self, releases: dict[int, Callable[[], None]]) -> None:
        """Writes are about to be queued with objects that are views of
        another tier's slots (no copy): run `releases[id(obj)]` (end the
        slot's hold) once every write of that object queued from now on is
        done, and once the caller's own count goes (`settle`)."""
        with self.state.meta:
            for key, release in releases.items():
                entry = self.state.holds.setdefault(key, [0, []])
                entry[0] += 1
                entry[1].append(release)

    def settle(self, objs: Iterable[torch.Tensor]) -> None:
        """Drop the count `keep` gave the caller (its writes are queued)."""
        self._unhold([id(o) for o in objs])

    def _live(self, items: Sequence[Item]) -> list[Item]:
        """Those of a writer's items still in flight (not deleted since they were queued)."""
        inflight = self.state.inflight
        with self.state.meta:
            return [it for it in items if id(it[1]) in inflight.get(it[0], ())]

    def _release(self, items: Sequence[Item]) -> None:
        """These queued writes are done (landed, refused or dropped)."""
        inflight = self.state.inflight
        with self.state.meta:
            for h, obj in items:
                writes = inflight.get(h)
                entry = writes.get(id(obj)) if writes else None
                if entry is None:  # deleted while queued: a later write's entry is not this one's
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del writes[id(obj)]
                    if not writes:
                        del inflight[h]
        self._unhold([id(obj) for _, obj in items])

    def _unhold(self, keys: Iterable[int]) -> None:
        done = []
        with self.state.meta:
            for key in keys:
                entry = self.state.holds.get(key)
                if entry is not None:
                    entry[0] -= 1
                    if entry[0] <= 0:
                        done += self.state.holds.pop(key)[1]
        for release in done:
            release()

    def persist(self, i: int, batch: Sequence[Item]) -> None:
        """Writer-thread body for tier i: put a batch, demoting victims below
        (tier 0's writer carries promotions, which it counts); a block
        deleted while queued does not come back (`put`'s `queued`)."""
        try:
            held = self.put(i, batch, queued=True)
            if i == 0:
                self.state.count(0, promoted=len(held))
            if self.state.journals[i] is not None:  # landed, or deleted while queued: not to be retried
                deleted = {h for h, _ in batch} - {h for h, _ in self._live(batch)}
                self.state.journals[i].forget(list(held | deleted))
        finally:
            self._release(batch)

    def quarantine(self, i: int, hashes: Sequence[BlockHash]) -> None:
        """Blocks tier i holds damaged: set aside there, dropped from its policy
        and the directory, counted as corrupt."""
        with self.state.locks[i]:
            self.state.tiers[i].quarantine(hashes)
            for h in hashes:
                self.state.policies[i].remove(h)
        self.state.publish(i, list(hashes), present=False)
        self.state.count(i, corrupt=len(hashes))

    def due(self, i: int, h: BlockHash) -> bool:
        """Count a hit of `h` in tier i > 0; True when it is the one that promotes."""
        n, seen_before = self.state.cfg.promote_after_hits, self.state.below_hits
        if n <= 1 or self.state.tiers[i].remote:
            return n >= 1
        with self.state.meta:
            seen = seen_before.pop(h, 0) + 1
            if seen < n:
                seen_before[h] = seen
                if len(seen_before) > _MAX_BELOW_HITS:
                    seen_before.popitem(last=False)
        return seen >= n

    def promote(self, hits: Sequence[tuple[int, BlockHash, torch.Tensor]]) -> None:
        """Hits from tier i go into tiers 0..i-1 in the background, so a load
        never waits on a copy into another tier. A full promotion queue drops
        them (the block is still where it was found)."""
        for i in range(len(self.state.tiers) - 1, 0, -1):
            items = [(h, obj) for k, h, obj in hits if k == i]
            if not items:
                continue
            self.submit(0, items, wait=False)
            for up in range(1, i):
                self.submit(up, items)

    def prefetch(self, ns: Namespace, hashes: Sequence[BlockHash]) -> int:
        """`TieredStore.prefetch`: the blocks below the top tier are read here,
        checked (a corrupt one is left where it is, for a load to quarantine)
        and promoted in the background whatever their hit counts."""
        tiers = self.state.tiers
        todo = [h for h, ok in zip(hashes, tiers[0].contains_many(hashes)) if not ok]
        hits: list[tuple[int, BlockHash, torch.Tensor]] = []
        for i in range(1, len(tiers)):
            if not todo:
                break
            tiers[i].note_namespace(ns.fingerprint())
            objs = tiers[i].get_many(todo)
            hits += [(i, h, obj) for h, obj in zip(todo, objs) if obj is not None and _sound(obj, ns, h)]
            todo = [h for h, obj in zip(todo, objs) if obj is None]
        self.promote(hits)
        return len(hits)


def _sound(obj: torch.Tensor, ns: Namespace, h: BlockHash) -> bool:
    try:
        decode(obj, ns, h, verify_payload=True)
        return True
    except CorruptBlockError as e:
        log.warning("prefetch: block %s is corrupt (%s); left for a load to quarantine", h.hex(), e)
        return False
