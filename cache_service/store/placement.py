"""How blocks move between a TieredStore's tiers: puts with eviction, victims
sent down, background writers, promotion of hits. `Placement` works on the
store's `StoreState` (cache_service/store/state.py), which it shares with
the store and with `SharedSlots`.

Locks: a tier's lock guards its membership and policy while a put evicts
and places; writers hold objects in the in-flight map (under ``meta``)
until they land, so a block stays visible while it moves down. The map
counts each queued object apart (by identity): a delete drops every write
of its blocks queued so far, and a write that ends later cannot end one
queued since (nor a slot hold taken for it, `keep`). Bytes read before they
are queued or put (victims, promotions, the retry tick's backlog) carry a
delete log mark (deletes.py): a delete after the read still wins.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Sequence

import torch

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import decode, intact, object_size
from cache_service.store.backlog import Backlog
from cache_service.store.state import StoreState
from cache_service.store.writer import Item
from tiers.base import Tier
from tiers.types import BlockHash, CapacityError, CorruptBlockError

log = logging.getLogger("tierkv.store")
STUCK_S = 5.0  # grace before a writer is stuck (TierWriter.submit_many): stores stop waiting, the journal takes theirs
_MAX_BELOW_HITS = 1 << 16  # blocks whose lower-tier hits are remembered (oldest forgotten first)


class Placement:
    """The store's placement machinery (see the module docstring)."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self._walked: dict[int, int] = {}  # tier -> its block count when its keys were last walked (_adopt_unknown)
        self.backlog = Backlog(state, self.put)  # what tiers refused while down, and the retry tick

    def put(self, i: int, items: Sequence[Item], owned: bool = True, retry: bool = False,
            queued: bool = False, since: int | None = None) -> set[BlockHash]:
        """Put items into tier i, evicting as needed; victims and items that
        cannot fit go down (copied first unless `owned`: the caller's buffers
        may be reused), or are deferred while tier i is down (always when
        `retry`: they were deferred before). `queued`: the items are a
        writer's, put only while still in flight; `since`: a delete log mark
        taken before the items were read, put only if not deleted since
        (both checked under the tier's lock, so a delete that ran first
        wins). Returns the hashes now held by tier i."""
        tier, pol = self.state.tiers[i], self.state.policies[i]
        victims: list[Item] = []
        mark = self.state.deletes.mark() if since is None else since  # before any victim is read out
        with self.state.locks[i]:
            if queued:
                items = self.live(items)
            if since is not None:
                items = self._undeleted(since, items)
            todo = [it for it, ok in zip(items, self._holds(i, [h for h, _ in items])) if not ok]
            ok = self._put_locked(i, todo, victims, mark)
            pol.insert_many([h for (h, _), good in zip(todo, ok) if good])
        self.state.publish(i, [h for (h, _), good in zip(todo, ok) if good])
        held = {h for h, _ in items} - {h for (h, _), good in zip(todo, ok) if not good}
        self.evicted(i, victims, mark)
        bypassed = [it for it, good in zip(todo, ok) if not good]
        if i and bypassed and (retry or not tier.available()):  # down for now: written once it is back
            self.backlog.defer(i, bypassed, mark)
            bypassed = []
        if not owned and i + 1 < len(self.state.tiers):
            bypassed = [(h, obj.clone()) for h, obj in bypassed]
        self.demote(i, bypassed, "bypassed", mark)
        return held

    def _undeleted(self, mark: int, items: Sequence[Item]) -> list[Item]:
        """Those of items not deleted since `mark` (deletes.py)."""
        gone = self.state.deletes.deleted(mark, [h for h, _ in items])
        return [it for it in items if it[0] not in gone] if gone else list(items)

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

    def _put_locked(self, i: int, todo: Sequence[Item], victims: list[Item], mark: int) -> list[bool]:
        tier = self.state.tiers[i]
        try:  # a tier's footprint is per size: asked once per size in the batch, not once per object
            need = sum(tier.footprint(n) * k for n, k in Counter(obj.numel() for _, obj in todo).items())
        except CapacityError:
            return [False] * len(todo)
        self.make_room(i, need, victims, mark)
        try:
            return tier.put_many([h for h, _ in todo], [obj for _, obj in todo])
        except CapacityError:  # one object can never fit: place the others one by one
            return [self._put_one(tier, it) for it in todo]

    def make_room(self, i: int, need: int, victims: list[Item], mark: int) -> None:
        """Evict from tier i (caller holds its lock) until `need` bytes are free
        or only pinned blocks are left; each victim, with its object when a
        tier below can take it, goes into `victims` (see `evicted`; `mark`:
        the delete log's, taken before the victims are read)."""
        tier = self.state.tiers[i]
        if need > tier.free_bytes():
            self._adopt_unknown(i)
        while (short := need - tier.free_bytes()) > 0:
            # as many victims as the tier's average block frees that much: one batched read and delete
            used, blocks = tier.stats.used_bytes, tier.stats.blocks
            pins = self.state.pins
            picked = self.state.policies[i].victims(-(-short // max(1, used // blocks)) if blocks else 1,
                                                    pins.is_pinned if pins.any() else None)
            if not picked:
                break
            objs = self._victim_objects(i, picked)
            self._journal_victims(i + 1, picked, objs, mark)
            with self.state.meta:  # in flight from here (found by lookups and loads) until they land below
                self._enter([(h, o) for h, o in zip(picked, objs) if o is not None])
            tier.delete_many(picked)
            self.state.publish(i, picked, present=False)
            victims.extend(zip(picked, objs))  # counted as evictions even with nowhere to go

    def _adopt_unknown(self, i: int) -> None:
        """Blocks tier i holds that its policy never saw (a disk's sweep re-indexes what an unclean stop
        left, after the policy was rebuilt at open) are given to the policy: never evicted, they held
        their room for good. Looked for when the tier holds more than the policy knows (one walk per count)."""
        pol, tier = self.state.policies[i], self.state.tiers[i]
        held = tier.stats.blocks
        if not pol.rebuilt_from_keys or len(pol) >= held or self._walked.get(i) == held:
            return
        self._walked[i] = held
        pol.insert_many([h for h in tier.keys() if h not in pol])  # oldest first

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

    def _journal_victims(self, i: int, picked: Sequence[BlockHash], objs: Sequence[torch.Tensor | None],
                         mark: int) -> None:
        """Before victims leave the tier above tier i: those tier i (a
        journaled one) does not hold yet go into its journal, so a write-back
        victim survives a crash or an outage before it lands."""
        if i < len(self.state.tiers) and self.state.journals[i] is not None:
            held = self.state.tiers[i].contains_many(picked)
            todo = [(h, o) for h, o, ok in zip(picked, objs, held) if o is not None and not ok]
            self.backlog.record(i, todo, mark)

    def evicted(self, i: int, victims: Sequence[Item], mark: int) -> None:
        """Count `make_room`'s victims and send them down (outside the tier's
        lock), unless deleted since `mark`."""
        self.state.count(i, evictions=len(victims))
        self.demote(i, [v for v in victims if v[1] is not None], "demoted", mark, entered=True)

    @staticmethod
    def _put_one(tier: Tier, item: Item) -> bool:
        try:
            return tier.put_many([item[0]], [item[1]])[0]
        except CapacityError:
            return False

    def demote(self, i: int, items: Sequence[Item], counter: str, since: int | None = None,
               entered: bool = False) -> None:
        """Send items evicted from (or not fitting in) tier i to tier i + 1
        (those deleted since `since`, a delete log mark, stay behind);
        `entered`: they are in the in-flight map already (`make_room`)."""
        if not items:
            return
        assert i + 1 < len(self.state.tiers) or not entered, "victims carry objects only when a tier is below"
        if i + 1 >= len(self.state.tiers):
            self.state.count(i, dropped=len(items) if counter == "bypassed" else 0)
            return
        below = self.state.tiers[i + 1].contains_many([h for h, _ in items])  # no need to write those there
        todo = [it for it, ok in zip(items, below) if not ok]
        if entered:
            self._release([it for it, ok in zip(items, below) if ok])
        self.state.count(i, **{counter: len(todo)})
        self.submit(i + 1, todo, since=since, entered=entered)

    def submit(self, i: int, items: Sequence[Item], wait: bool | None = None, since: int | None = None,
               entered: bool = False) -> None:
        """Queue items for writer i, in the in-flight map until they land (a
        full queue waits or drops, per ``cfg.queue_full`` unless `wait` says;
        a wait on a tier with an upload journal ends once its writer has been
        on one batch for STUCK_S, and the journal takes the rest;
        items deleted since `since`, a delete log mark, are not queued;
        `entered`: the items are in the map already)."""
        st = self.state
        wait = st.cfg.queue_full == "wait" if wait is None else wait
        with st.meta:  # a delete empties the in-flight map of its blocks under meta, after it starts
            gone = st.deletes.deleted(since, [h for h, _ in items]) if since is not None else set()
            if not entered:
                self._enter([it for it in items if it[0] not in gone])
        if gone:
            if entered:
                self._release([it for it in items if it[0] in gone])
            items = [it for it in items if it[0] not in gone]
        journaled = wait and st.journals[i] is not None
        queued = st.writers[i].submit_many(items, wait, STUCK_S if journaled else None)
        if queued < len(items):
            rest = items[queued:]
            if journaled:  # the writer is stuck (an S3 that hangs): the journal takes the rest, the store goes on
                mark = st.deletes.mark()
                self.backlog.defer(i, self.live(rest), mark)
            else:
                st.count(i, dropped=len(rest))
            self._release(rest)

    def _enter(self, items: Sequence[Item]) -> None:
        """Put queued writes in the in-flight map (caller holds ``meta``)."""
        st = self.state
        for h, obj in items:
            st.inflight.setdefault(h, {}).setdefault(id(obj), [obj, 0])[1] += 1

    def live(self, items: Sequence[Item]) -> list[Item]:
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

    def journal_unwritten(self) -> None:
        """Writes a closing store gives up on, for a tier with an upload
        journal, go into the journal (durable, written at the next open): a
        store that acknowledged them loses none to an S3 that hangs."""
        for i, (w, journal) in enumerate(zip(self.state.writers, self.state.journals)):
            if journal is not None:
                mark = self.state.deletes.mark()
                items = self.live(w.unwritten())
                kept = self.backlog.record(i, items, mark) if items else []
                if kept:
                    log.warning("close: %d blocks not yet written to %s kept in its journal", len(kept), w.name)

    def persist(self, i: int, batch: Sequence[Item]) -> None:
        """Writer-thread body for tier i: put a batch, demoting victims below
        (tier 0's writer carries promotions, which it counts); a block
        deleted while queued does not come back (`put`'s `queued`)."""
        try:
            held = self.put(i, batch, queued=True)
            if i == 0:
                self.state.count(0, promoted=len(held))
            if self.state.journals[i] is not None:  # landed, or deleted while queued: not to be retried
                deleted = {h for h, _ in batch} - {h for h, _ in self.live(batch)}
                self.state.journals[i].forget(list(held | deleted))
        finally:
            self._release(batch)

    def quarantine(self, i: int, hashes: Sequence[BlockHash], seen: Sequence[torch.Tensor] | None = None) -> None:
        """Blocks tier i holds damaged: set aside there, dropped from its policy
        and the directory, counted as corrupt. `seen`: the objects found
        damaged; a block whose object in the tier differs now (deleted and
        stored again since the read) is left alone."""
        with self.state.locks[i]:  # no put into tier i between the comparison and the quarantine
            if seen is not None:
                now = self.state.tiers[i].get_many(hashes)
                hashes = [h for h, o, s in zip(hashes, now, seen) if o is not None and torch.equal(o, s)]
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

    def promote(self, hits: Sequence[tuple[int, BlockHash, torch.Tensor]], mark: int) -> None:
        """Hits from tier i go into tiers 0..i-1 in the background, so a load
        never waits on a copy into another tier (unless deleted since `mark`,
        the delete log's, taken before they were read). A full promotion
        queue drops them (the block is still where it was found)."""
        for i in range(len(self.state.tiers) - 1, 0, -1):
            items = [(h, obj) for k, h, obj in hits if k == i]
            if not items:
                continue
            self.submit(0, items, wait=False, since=mark)
            for up in range(1, i):
                self.submit(up, items, since=mark)

    def prefetch(self, ns: Namespace, hashes: Sequence[BlockHash]) -> int:
        """`TieredStore.prefetch`: the blocks below the top tier are read here,
        checked (a corrupt one is left where it is, for a load to quarantine)
        and promoted in the background whatever their hit counts."""
        tiers, mark = self.state.tiers, self.state.deletes.mark()
        todo = [h for h, ok in zip(hashes, tiers[0].contains_many(hashes)) if not ok]
        hits: list[tuple[int, BlockHash, torch.Tensor]] = []
        for i in range(1, len(tiers)):
            if not todo:
                break
            tiers[i].note_namespace(ns.fingerprint(), object_size(ns))
            objs = tiers[i].get_many(todo)
            hits += [(i, h, obj) for h, obj in zip(todo, objs) if obj is not None and _sound(obj, ns, h)]
            todo = [h for h, obj in zip(todo, objs) if obj is None]
        self.promote(hits, mark)
        return len(hits)


def _sound(obj: torch.Tensor, ns: Namespace, h: BlockHash) -> bool:
    try:
        decode(obj, ns, h, verify_payload=True)
        return True
    except CorruptBlockError as e:
        log.warning("prefetch: block %s is corrupt (%s); left for a load to quarantine", h.hex(), e)
        return False
