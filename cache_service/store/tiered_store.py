"""TieredStore: block lookup, load and store over an ordered list of tiers.

Tiers are ordered top (fastest) to bottom. ``store()`` puts objects into the
top tier synchronously and returns; every lower tier is written by its own
background writer (write-through tiers get every new block, write-back tiers
get blocks when they are evicted from the tier above). ``load()`` reads each
block from the highest tier that has it, verifies it, and promotes a block
into the tiers above on its ``promote_after_hits``-th hit below (default 2:
a one-shot read from local disk copies nothing, as the engine keeps what it
loaded; a hit in S3 is copied up at once), in the background, so a load
returns as soon as its blocks are read; a promotion that finds its queue
full is dropped. Eviction is the store's job: each tier has a policy, pinned
blocks are never victims, and a victim moves to the next tier down
(evictions are counted even where there is no tier below).

Copy-free variants for callers with buffers of their own (the daemon's shared
memory): ``load_into`` copies a slot-pool hit into the caller's buffer and
verifies it there; ``store_objects`` copies encoded objects once into the top.

Backpressure: with ``queue_full = "wait"`` (default) a full writer queue
makes the caller wait (bounded memory, no lower copy lost); with ``"skip"``
the lower copy is dropped and counted (``dropped``).

Three parts over one `StoreState` (state.py): placement (placement.py),
objects another process writes into a shared top tier (shared_slots.py), and
lookups, loads and stores here. Locks: one per tier, top to bottom; objects
handed to writers stay in an in-flight map, seen by ``lookup`` and ``load``.

Directory (optional, cache_service/directory/): blocks landing where other
nodes can see them (this node's disk, S3) are published, gone ones
unpublished, off the caller's path. A lookup asks it only about what its own
tiers miss; a block it places in S3 counts as held and ``load`` reads it there.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from cache_service.blocks.encoding import encode_many, pick
from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import HEADER_SIZE, checksums, decode, encode_into, object_size, require, verify
from cache_service.config import StoreConfig
from cache_service.store.eviction.base import EvictionPolicy
from cache_service.store.pins import PinBook
from cache_service.store.placement import Placement
from cache_service.store.prefix import chunked_prefix, covered, held_prefix
from cache_service.store.shared_slots import SharedSlots
from cache_service.store.state import StoreState
from cache_service.store.writer import Item, TierWriter
from tiers.base import SlotTier, Tier
from tiers.types import BlockHash, CorruptBlockError, TierKVError

if TYPE_CHECKING:
    from cache_service.directory.redis_directory import RedisDirectory
    from cache_service.store.journal import UploadJournal

log = logging.getLogger("tierkv.store")


class TieredStore:
    """The block store; thread-safe. Build with `open_store(config)` or directly."""

    def __init__(self, tiers: Sequence[Tier], policies: Sequence[EvictionPolicy],
                 write_modes: Sequence[str], cfg: StoreConfig | None = None,
                 directory: "RedisDirectory | None" = None, journals: Mapping[str, "UploadJournal"] = {}) -> None:
        """`journals`: tier name -> the upload journal of that tier (journal.py)."""
        st = self._state = StoreState(list(tiers), list(policies), list(write_modes), cfg or StoreConfig(), directory,
                                      journals=[journals.get(t.name) for t in tiers])
        self.tiers, self.modes, self.cfg, self.directory = st.tiers, st.modes, st.cfg, st.directory  # for callers
        self._s3 = next((t for t in tiers if t.name == "s3"), None) if directory is not None else None  # S3 via the directory
        self._placement = moves = Placement(st)
        self._slots = SharedSlots(st, moves)
        # writer 0 promotes hits into the top tier; writer i > 0 fills tier i
        st.writers[:] = [TierWriter(t.name if i else f"{t.name}-promote", st.cfg.queue_depth, partial(moves.persist, i),
                                    tick=partial(moves.backlog.retry, i) if i else None)
                         for i, t in enumerate(st.tiers)]
        for pol, tier in zip(st.policies, st.tiers):  # oldest first: recency survives a restart
            pol.insert_many(tier.keys() if pol.rebuilt_from_keys else [])
        if directory is not None:
            directory.on_register(st.announce)

    # ------------------------------------------------------------------ queries
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of `hashes` that some tier fully holds."""
        with self._state.meta:
            inflight = self._state.inflight
            asked = [(0, list(map(inflight.__contains__, hashes)))] if inflight else []
        n = held_prefix(hashes, [t for t in self.tiers if t.available()], asked)  # one in an outage: loads miss
        if n < len(hashes) and self._s3 is not None and self._s3.available():  # in an outage a load there misses
            n = chunked_prefix(n, len(hashes), lambda a, b: self._or_in_s3(hashes[a:b], covered(asked, a, b)))
        return n

    def holds(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether some tier here holds each block, or it is on its way down, or (the directory says) in S3."""
        with self._state.meta:
            moving = [h in self._state.inflight for h in hashes]
        held = [any(col) for col in zip(moving, *(t.contains_many(hashes) for t in self.tiers))]
        return self._or_in_s3(hashes, held) if self._s3 is not None else held

    def _or_in_s3(self, hashes: Sequence[BlockHash], held: list[bool]) -> list[bool]:
        """`held`, or in S3 as the directory says: one batched request for the misses."""
        ask = [h for h, ok in zip(hashes, held) if not ok]
        in_s3 = dict(zip(ask, self.directory.in_s3(ask))) if ask else {}
        return [ok or in_s3[h] for h, ok in zip(hashes, held)]

    def load(self, ns: Namespace, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Verified payloads ([layers, 2, block_tokens, kv_heads, head_dim]) per
        hash, None for a miss. A corrupt object is quarantined, counted and
        looked for in the next tier down."""
        return self._load_from(0, ns, hashes)

    def load_into(self, ns: Namespace, hashes: Sequence[BlockHash],
                  outs: Sequence[torch.Tensor] | torch.Tensor) -> list[bool]:
        """Copy each block's object (header + payload) into `outs[j]` (1-D uint8
        CPU tensor of object_size(ns) bytes; or `outs` is one ``[n, object_size]``
        tensor, whose headers are then checked in one pass); True per hit.

        The allocation-free load: a hit in a `SlotTier` (the slot pools) is
        one copy, from the slot straight into the caller's buffer,
        then verified there. Blocks those tiers miss are read as by `load`
        (promoted likewise) and written into their buffers. A miss leaves its
        buffer's contents undefined.
        """
        assert len(hashes) == len(outs), "one buffer per hash"
        size = object_size(ns)
        rows = outs if isinstance(outs, torch.Tensor) else None
        assert rows is None or tuple(rows.shape[1:]) == (size,), "rows of object_size bytes"
        outs = list(rows.unbind(0)) if rows is not None else [o[:size] for o in outs]
        got = [False] * len(hashes)
        remaining = list(range(len(hashes)))
        promote: list[tuple[int, BlockHash, torch.Tensor]] = []
        i, mark = 0, self._state.deletes.mark()  # hits read before a delete are not promoted after it
        while remaining and i < len(self.tiers) and isinstance(self.tiers[i], SlotTier):
            good = self._copied_in(i, ns, hashes, outs, rows, remaining)
            if good is None:
                break
            missed = []
            for j in remaining:
                if j in good:
                    got[j] = True
                    if i and self._placement.due(i, hashes[j]):  # the caller's buffer is reused: promote a copy
                        promote.append((i, hashes[j], outs[j].clone()))
                else:
                    missed.append(j)
            self._settle(i, hashes, remaining, missed)
            remaining, i = missed, i + 1
        self._placement.promote(promote, mark)
        if remaining:
            for j, p in zip(remaining, self._load_from(i, ns, [hashes[j] for j in remaining])):
                if p is not None:
                    encode_into(outs[j], ns, hashes[j], p)
                    got[j] = True
        return got

    def _copied_in(self, i: int, ns: Namespace, hashes: Sequence[BlockHash], outs: list[torch.Tensor],
                   rows: torch.Tensor | None, asked: list[int]) -> set[int] | None:
        """Those of `asked` whose objects slot tier i copied into their buffers,
        sound there (None: the tier cannot serve this namespace's buffers)."""
        # a tier that wants payloads verified has them hashed as they are copied (still in cache)
        digest = HEADER_SIZE if self.tiers[i].verify_payload else None
        try:
            hits = self.tiers[i].get_into([hashes[j] for j in asked], [outs[j] for j in asked], digest)
        except TierKVError:  # an object larger than this namespace's: not what was asked for
            return None
        found = [j for j, hit in zip(asked, hits) if hit is not None and hit is not False]
        sums = dict(zip(asked, hits)) if digest is not None else None
        return set(self._verified_in_place(i, ns, hashes, outs, found, rows, sums))

    def _load_from(self, first: int, ns: Namespace, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """`load` over tiers first.. (the ones above have been asked already).
        The writes in flight are asked after the top tier and before the
        lower ones: a write that lands meanwhile is then found where it landed
        (asked after them, it could leave the map between the two reads)."""
        out: list[torch.Tensor | None] = [None] * len(hashes)
        promote: list[tuple[int, BlockHash, torch.Tensor]] = []
        remaining, mark = list(range(len(hashes))), self._state.deletes.mark()
        if first == 0:
            remaining = self._read_tiers(0, 1, ns, hashes, remaining, out, promote)
        self._load_inflight(ns, hashes, remaining, out)
        remaining = [j for j in remaining if out[j] is None]
        self._read_tiers(max(first, 1), len(self.tiers), ns, hashes, remaining, out, promote)
        self._placement.promote(promote, mark)
        return out

    def _read_tiers(self, first: int, end: int, ns: Namespace, hashes: Sequence[BlockHash], remaining: list[int],
                    out: list, promote: list) -> list[int]:
        """Read `remaining` (indexes into hashes) from tiers first..end-1, top down, into `out`; the ones missed."""
        for i in range(first, end):
            if not remaining:
                break
            self.tiers[i].note_namespace(ns.fingerprint(), object_size(ns))  # S3 finds blocks other nodes wrote
            objs = self.tiers[i].get_many([hashes[j] for j in remaining])
            self._state.publish(i, self.tiers[i].take_gone(), present=False)  # stale directory entries
            missed = []
            for j, obj in zip(remaining, objs):
                if obj is not None and self._accept(i, ns, hashes[j], obj, out, j):
                    if i and self._placement.due(i, hashes[j]):
                        promote.append((i, hashes[j], obj))
                else:
                    missed.append(j)
            self._settle(i, hashes, remaining, missed)
            remaining = missed
        return remaining

    def _settle(self, i: int, hashes: Sequence[BlockHash], asked: list[int], missed: list[int]) -> None:
        """Recency and hit/miss counters of tier i after one batched read."""
        missed_set = set(missed)
        self._state.touch(i, [hashes[j] for j in asked if j not in missed_set])
        self._state.count(i, hits=len(asked) - len(missed), misses=len(missed))

    def _accept(self, i: int, ns: Namespace, h: BlockHash, obj: torch.Tensor, out: list, j: int) -> bool:
        out[j] = self._verified(i, ns, h, obj)
        return out[j] is not None

    def _verified_in_place(self, i: int, ns: Namespace, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor],
                           found: list[int], rows: torch.Tensor | None, sums: dict[int, int] | None) -> list[int]:
        """Those of `found` (indexes into hashes / objs) whose objects, read from
        tier i, are sound: the hot path's checks (each header compared with
        the one (ns, h) must have, the payloads hashed unless `sums` has
        their checksums already); the full decode (for its diagnosis) only
        for the rest. `rows`: objs as one [n, object_size] tensor, if they are."""
        if rows is not None and found:  # all rows in one pass (indexing rows would copy them)
            every = verify(rows, ns, hashes, payload=False)
            claims = [every[j] for j in found]
        else:
            claims = verify([objs[j] for j in found], ns, [hashes[j] for j in found], payload=False)
        if self.tiers[i].verify_payload:  # and the payloads, unless hashed as they were copied
            sums = sums or dict(zip(found, checksums([objs[j][HEADER_SIZE:] for j in found])))
            claims = [c if c is not None and c == sums[j] else None for j, c in zip(found, claims)]
        ok = {j for j, c in zip(found, claims) if c is not None}
        return [j for j in found if j in ok or self._verified(i, ns, hashes[j], objs[j]) is not None]

    def _verified(self, i: int, ns: Namespace, h: BlockHash, obj: torch.Tensor) -> torch.Tensor | None:
        """The payload of an object read from tier i; None (quarantined) if corrupt."""
        try:
            return decode(obj, ns, h, verify_payload=self.tiers[i].verify_payload)
        except CorruptBlockError as e:
            log.warning("tier %s: block %s is corrupt (%s); quarantined", self.tiers[i].name, h.hex(), e)
            self._placement.quarantine(i, [h], [obj])
            return None

    def _load_inflight(self, ns: Namespace, hashes: Sequence[BlockHash], todo: list[int], out: list) -> None:
        with self._state.meta:  # copied while the entry stands: its object may be a held slot's view
            writes = [(j, self._state.inflight.get(hashes[j])) for j in todo]
            found = [(j, list(w.values())[-1][0].clone()) for j, w in writes if w]  # the latest queued
        for j, obj in found:
            out[j] = decode(obj, ns, hashes[j], verify_payload=False)

    # ------------------------------------------------------------------ writes
    def store(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor] | torch.Tensor) -> int:
        """Encode and store blocks (a payload each, or one tensor whose rows are the blocks); returns once
        the top tier holds them (or, when it is full of pinned blocks, once they are queued below): how
        many blocks were new to the top tier."""
        if len(hashes) != len(payloads):
            raise ValueError(f"{len(hashes)} hashes but {len(payloads)} payloads")
        held = self.tiers[0].contains_many(hashes)
        todo = [i for i, ok in enumerate(held) if not ok]
        keys = [hashes[i] for i in todo]
        objs = encode_many(ns, keys, payloads if len(todo) == len(held) else pick(ns, payloads, todo))
        return self._store_new(hashes, held, list(zip(keys, objs)), owned=True)

    def store_objects(self, ns: Namespace, hashes: Sequence[BlockHash], objs: Sequence[torch.Tensor],
                      verify: bool = True, owned: bool = False) -> int:
        """Store already-encoded objects (1-D uint8 CPU tensors), copied once into the top tier; as
        `store`. They must not change meanwhile: copy out of memory another process writes first.

        With `verify` (untrusted bytes) every header and payload checksum is
        checked first and a bad object raises CorruptBlockError, storing
        nothing. Without `owned` the caller may reuse `objs` once this returns,
        so what lower tiers write later is copied out first.
        """
        if len(hashes) != len(objs):
            raise ValueError(f"{len(hashes)} hashes but {len(objs)} objects")
        if verify:
            require(list(objs), ns, hashes)
        held = self.tiers[0].contains_many(hashes)
        new = [(h, obj) for h, obj, ok in zip(hashes, objs, held) if not ok]
        return self._store_new(hashes, held, new, owned)

    def _store_new(self, hashes: Sequence[BlockHash], held: list[bool], new: list[Item], owned: bool) -> int:
        self._state.touch(0, [h for h, ok in zip(hashes, held) if ok])
        stored = self._placement.put(0, new, owned)
        through = self._state.through()
        if through and not owned:  # writers hold objects past this call
            new = [(h, obj.clone()) for h, obj in new]
        keys = [h for h, _ in new]
        for i in through:  # a tier that rechecks its copies reads back those it has (Placement._holds)
            held = [False] * len(new) if self.tiers[i].rechecks else self.tiers[i].contains_many(keys)
            self._placement.submit(i, [it for it, ok in zip(new, held) if not ok])
        return len(stored)

    # ------------------------------------------------------------------ a shared top tier (SharedSlots)
    def shared_pool(self) -> SlotTier | None:
        """The top tier when other processes may write its slots, else None."""
        return self._slots.shared_pool()

    def reserve(self, ns: Namespace, keys: Sequence[BlockHash]) -> list[int]:
        """A slot per key for a client to write its object into (`SharedSlots.reserve`)."""
        return self._slots.reserve(ns, keys)

    def reserve_spare(self, ns: Namespace, n: int) -> list[int]:
        """Up to n slots for blocks named at `commit` (`SharedSlots.reserve_spare`)."""
        return self._slots.reserve_spare(ns, n)

    def spares_done(self, n: int) -> None:
        """n spare slots were committed or handed back."""
        self._slots.spares_done(n)

    def commit(self, sent_ns: Namespace, sent: Sequence[BlockHash], ns: Namespace,
               keys: Sequence[BlockHash], slots: Sequence[int]) -> int:
        """Publish reserved slots the client wrote as blocks (`SharedSlots.commit`)."""
        return self._slots.commit(sent_ns, sent, ns, keys, slots)

    def spare_limit(self, ns: Namespace) -> int:
        """How many spare slots one client may hold (`SharedSlots.spare_limit`)."""
        return self._slots.spare_limit(ns)

    def unreserve(self, slots: Sequence[int]) -> None:
        """Hand back reserved slots that will not be committed."""
        self._slots.unreserve(slots)

    def hold(self, keys: Sequence[BlockHash]) -> list:
        """The shared top tier's (slot, view) per held key, kept from reuse until `let_go` (`SharedSlots.hold`)."""
        return self._slots.hold(keys)

    def let_go(self, held: Sequence) -> None:
        """End `hold`s."""
        self._slots.let_go(held)

    # ------------------------------------------------------------------ admin
    def delete(self, hashes: Sequence[BlockHash]) -> int:
        """Remove blocks from every tier; returns how many tier copies went."""
        st = self._state
        with st.deletes.deleting(hashes):  # no write of bytes read before this lands after it (deletes.py)
            with st.meta:
                for h in hashes:
                    st.inflight.pop(h, None)
                    for later in st.deferred:
                        later.pop(h, None)
            st.pins.forget(hashes)
            n = 0
            for journal in (j for j in st.journals if j is not None):  # not to be uploaded after all
                journal.forget(hashes)
            for i, tier in enumerate(self.tiers):
                with st.locks[i]:
                    n += tier.delete_many(hashes)
                    for h in hashes:
                        st.policies[i].remove(h)
                st.publish(i, hashes, present=False)
        return n

    @property
    def pins(self) -> PinBook:
        """Block pins (`pin`, `unpin`) and session pins (`pin_session`, `unpin_session`): pins.py."""
        return self._state.pins

    def prefetch(self, ns: Namespace, hashes: Sequence[BlockHash]) -> int:
        """Copy those of `hashes` held only below up into the top tier, in the background; how many were queued."""
        return self._placement.prefetch(ns, hashes)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: the store's counters (hits, misses: the store's, not the tier's eviction reads;
        evictions, corrupt, ...) with the tier's own (bytes, blocks, capacity), queue depth, journal."""
        return self._state.stats()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every background write and promotion has landed (True) or timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._state.writers:  # promotions first: their evictions feed the writers below
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not w.flush(left):
                return False
        if self.directory is not None:  # publishing is best effort: an outage is not a flush failure
            self.directory.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True

    def close(self) -> None:
        """Flush background writes (up to cfg.flush_timeout_s), then close tiers."""
        if not self.flush(self.cfg.flush_timeout_s):
            log.warning("close: background writes did not finish within %.0fs", self.cfg.flush_timeout_s)
            self._placement.journal_unwritten()
        for w in self._state.writers:
            w.stop(1.0)
        for tier in self.tiers:
            tier.close()
        for journal in (j for j in self._state.journals if j is not None):  # an empty one too (len 0)
            journal.close()
        if self.directory is not None:
            self.directory.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

