"""Shared-slot puts: block objects another process writes straight into the
top tier's slots. `SharedSlots` works on the store's `StoreState`
(cache_service/store/state.py) and makes room through its `Placement`.

The daemon's host pool can live in shared memory (`SlotPool(shared=True)`)
that a same-host client maps (cache_service/server/pool.py). A store then costs one
copy instead of two: `reserve` makes room (evicting as a put would) and
hands out free slots that belong to nobody; the client encodes each block's
object into its slot (each payload copied and hashed in one pass, while in
cache); `commit` checks every header (a slot never written, or written for
another block, fails the commit), re-heads the objects for the store's keys
when they differ from what the client named (tenants), and publishes them:
from then on they are blocks like any other (policy, directory,
write-through copies below). The client does the copy and the hash, the
daemon only checks headers, so neither reads the bytes twice and the two
do not compete for memory bandwidth. Payload checksums are the client's,
as on every store path; a pool others write is verified on every load
(`verify_payload`), so a payload that does not match its checksum is a
miss, never a wrong answer. The write-through tiers below get checked copies
(`_write_through`), not the slots the client can still write.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import HEADER_SIZE, diagnose, object_size, rehead, verify
from cache_service.store.placement import Placement
from cache_service.store.state import StoreState
from cache_service.store.writer import Item
from tiers.base import SlotTier
from tiers.host_copy import copy_hashed
from tiers.types import BlockHash, CapacityError

HELD, NO_ROOM = -1, -2  # `reserve`'s answers for a block that gets no slot


class SharedSlots:
    """`reserve` / `commit` / `unreserve` on a shared top tier (module docstring)."""

    def __init__(self, state: StoreState, placement: Placement) -> None:
        self.state, self.placement = state, placement

    def shared_pool(self) -> SlotTier | None:
        """The top tier when other processes may write its slots, else None."""
        top = self.state.tiers[0]
        return top if isinstance(top, SlotTier) and top.shared else None

    def reserve(self, ns: Namespace, keys: Sequence[BlockHash]) -> list[int]:
        """A slot of the shared top tier per key to write its object into, or
        HELD (the tier has it: its recency is refreshed) or NO_ROOM (full of
        pinned blocks, the object cannot fit a slot, or the key came earlier
        in `keys`: store it the usual way). Slots not committed must be
        handed back (`unreserve`)."""
        pool, size = self.shared_pool(), object_size(ns)
        assert pool is not None, "reserve needs a shared top tier"
        with self.state.locks[0]:
            held = pool.contains_many(keys)
            todo = [k for k, ok in zip(keys, held) if not ok]
            slots, victims, mark = self._make_slots(pool, size, len(set(todo)), lambda: pool.reserve(todo, size))
        self._victims_down(pool, victims, mark, slots)
        self.state.touch(0, [k for k, ok in zip(keys, held) if ok])
        got = iter(slots or [None] * len(todo))
        out = []
        for ok in held:
            slot = None if ok else next(got)
            out.append(HELD if ok else NO_ROOM if slot is None else slot)
        return out

    def reserve_spare(self, ns: Namespace, n: int) -> list[int]:
        """Up to n slots of the shared top tier, made room for as `reserve`
        does, for blocks a client will name at `commit` (its next store starts
        filling them without a round trip). At most 1/8 of the tier is spare
        at a time, over all clients; hand back (`spares_done`) any not
        committed."""
        pool, size = self.shared_pool(), object_size(ns)
        with self.state.meta:
            n = min(n, pool.num_slots // 8 - self.state.spares_out)
            self.state.spares_out += max(0, n)
        if n <= 0:
            return []
        with self.state.locks[0]:
            slots, victims, mark = self._make_slots(pool, size, n, lambda: pool.reserve_free(n, size))
        self.spares_done(n - len(slots or []))
        try:
            self._victims_down(pool, victims, mark, slots)
        except BaseException:
            self.spares_done(len(slots or []))
            raise
        return slots or []

    def spares_done(self, n: int) -> None:
        """n spare slots were committed or handed back."""
        with self.state.meta:
            self.state.spares_out -= n

    def _make_slots(self, pool: SlotTier, size: int, n: int, take) -> tuple[list | None, list[Item], int]:
        """take() after evicting room for n objects of `size` (caller holds the
        top tier's lock): (its slots, or None when the objects cannot fit a
        slot; the victims and a delete log mark taken before they were read,
        for `_victims_down` once the lock is released)."""
        victims: list[Item] = []
        mark = self.state.deletes.mark()
        try:
            self.placement.make_room(0, n * pool.footprint(size), victims, mark)
        except CapacityError:
            return None, victims, mark
        return take(), victims, mark

    def _victims_down(self, pool: SlotTier, victims: list[Item], mark: int, slots: list | None) -> None:
        """`Placement.evicted`; if that fails, the slots just taken go back first, so none is lost."""
        try:
            self.placement.evicted(0, victims, mark)
        except BaseException:
            pool.unreserve([s for s in slots or [] if s is not None])
            raise

    def commit(self, sent_ns: Namespace, sent: Sequence[BlockHash], ns: Namespace,
               keys: Sequence[BlockHash], slots: Sequence[int]) -> int:
        """Publish reserved `slots`, into which the client wrote the objects of
        `sent` under `sent_ns`, as the blocks `keys` under `ns`. All or
        nothing: an object that cannot fit a slot raises CapacityError, a
        header that is not exactly its block's (a slot never written, or
        written for another block) CorruptBlockError, and every slot goes
        back. Returns how many blocks were new to the top tier."""
        pool, size = self.shared_pool(), object_size(ns)
        assert pool is not None and len(sent) == len(keys) == len(slots)
        try:
            pool.footprint(size)
            idx = torch.tensor(list(slots), dtype=torch.long)
            claims = verify(pool.rows[:, :HEADER_SIZE].index_select(0, idx), sent_ns, sent, payload=False)
            bad = next((j for j, c in enumerate(claims) if c is None), None)
            if bad is not None:
                raise diagnose(pool.rows[slots[bad], :size], sent_ns, sent[bad], payload=False)
            if (sent_ns, list(sent)) != (ns, list(keys)):  # a tenant's keys: the payloads stay, headers change
                rehead(pool.rows, ns, keys, claims, at=slots)
        except BaseException:
            pool.unreserve(slots)
            raise
        with self.state.locks[0]:
            done = pool.publish(keys, slots, size)
            new = [k for k, ok in zip(keys, done) if ok]
            for k in new:
                self.state.policies[0].insert(k)
            through = self.state.through()
            held = pool.hold(new) if through else []  # under the lock: nothing evicted them yet
        self.state.publish(0, new)
        self._write_through(pool, ns, through, new, held)
        return len(new)

    def _write_through(self, pool: SlotTier, ns: Namespace, through: list[int], keys: list[BlockHash],
                       held: list) -> None:
        """Queue the new blocks for the write-through tiers as copies of their
        slots, checked as they are copied (one pass), of those some tier below
        does not hold yet. Not views: the client can still write its slots, the
        tiers below keep what they are given, and a slot written after a check
        would reach the disk as a sound block (a load from the pool checks its
        payload; one from the disk would not)."""
        held_entries = [(k, e) for k, e in zip(keys, held) if e is not None]
        entries: list = []
        try:  # every slot held is let go, whatever fails here
            needed = {i: [k for k, has in zip(keys, self.state.tiers[i].contains_many(keys)) if not has]
                      for i in through}
            wanted = set().union(*needed.values())
            entries = [(k, e) for k, e in held_entries if k in wanted]
            if entries:
                copies = torch.empty(len(entries), entries[0][1][1].numel(), dtype=torch.uint8)
                sums = copy_hashed(list(copies.numpy()), [e[1].numpy() for _, e in entries], HEADER_SIZE)
        finally:
            pool.let_go([e for _, e in held_entries])
        if not entries:
            return
        sound = verify(copies, ns, [k for k, _ in entries], sums)
        bad = [k for (k, _), ok in zip(entries, sound) if ok is None]
        if bad:
            self.placement.quarantine(0, bad)
        items = {k: obj for (k, _), obj, ok in zip(entries, copies.unbind(0), sound) if ok is not None}
        for i, ks in needed.items():
            self.placement.submit(i, [(k, items[k]) for k in ks if k in items])

    def spare_limit(self, ns: Namespace) -> int:
        """How many spare slots (`reserve_spare`) one client may hold: 1/16 of the shared top tier."""
        pool = self.shared_pool()
        try:
            return max(1, pool.capacity_bytes // pool.footprint(object_size(ns)) // 16)
        except CapacityError:
            return 0

    def hold(self, keys: Sequence[BlockHash]) -> list:
        """(slot, object view) per key the shared pool holds (None: not
        there), kept from reuse until `let_go`: a same-host client reads them
        in place. Counted as hits (and their recency refreshed) like a load."""
        held = self.shared_pool().hold(keys)
        hits = [k for k, entry in zip(keys, held) if entry is not None]
        self.state.touch(0, hits)
        self.state.count(0, hits=len(hits), misses=len(keys) - len(hits))
        return held

    def let_go(self, held: Sequence) -> None:
        self.shared_pool().let_go(held)

    def unreserve(self, slots: Sequence[int]) -> None:
        """Hand back reserved slots that will not be committed."""
        if slots:
            self.shared_pool().unreserve(slots)
