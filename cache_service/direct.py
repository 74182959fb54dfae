"""Direct puts: block payloads another process writes straight into the top
tier's slots (mixed into `TieredStore`, whose tiers, policies, locks and
placement helpers it uses).

The daemon's host pool can live in shared memory (`SlotPool(shared=True)`)
that a same-host client maps (cache_service/pool.py). A store then costs one
copy instead of two: `reserve` makes room (evicting as a put would) and
hands out free slots that belong to nobody; the client copies each block's
payload into its slot; `commit` seals them (computes each payload's
checksum and writes each header, for the store's keys) and publishes them:
from then on they are blocks like any other (policy, directory,
write-through copies below). The client and the daemon work at once: while
the daemon seals one part of a store, the client fills the next (see
connectors/grpc_shm.py), and the daemon hashes bytes that were written a
moment ago, mostly from cache. A pool others write is verified on every
load (`verify_payload`), so a payload changed after its commit is a miss,
never a wrong answer.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cache_service.keys import Namespace
from cache_service.objects import HEADER_SIZE, headers, object_size, payload_checksum
from cache_service.writer import Item
from tiers.types import BlockHash, CapacityError

HELD, NO_ROOM = -1, -2  # `reserve`'s answers for a block that gets no slot


class DirectPuts:
    """`reserve` / `commit` / `unreserve` on a shared top tier (module docstring)."""

    def shared_pool(self):
        """The top tier when other processes may write its slots, else None."""
        top = self.tiers[0]
        return top if getattr(top, "shared", False) else None

    def reserve(self, ns: Namespace, keys: Sequence[BlockHash]) -> list[int]:
        """A slot of the shared top tier per key to write its object into, or
        HELD (the tier has it: its recency is refreshed) or NO_ROOM (full of
        pinned blocks, or the object cannot fit a slot: store it the usual
        way). Slots not committed must be handed back (`unreserve`)."""
        pool, size = self.shared_pool(), object_size(ns)
        assert pool is not None, "reserve needs a shared top tier"
        victims: list[Item] = []
        with self._locks[0]:
            held = pool.contains_many(keys)
            todo = [k for k, ok in zip(keys, held) if not ok]
            try:
                need = len(set(todo)) * pool.footprint(size)
                self._make_room(0, need, victims)
                slots = iter(pool.reserve(todo, size))
            except CapacityError:
                slots = iter([None] * len(todo))
        self._evicted(0, victims)
        self._touch(0, [k for k, ok in zip(keys, held) if ok])
        out = []
        for ok in held:
            slot = None if ok else next(slots)
            out.append(HELD if ok else NO_ROOM if slot is None else slot)
        return out

    def commit(self, ns: Namespace, keys: Sequence[BlockHash], slots: Sequence[int]) -> int:
        """Seal and publish reserved `slots`, into which the client copied the
        payloads of blocks `keys` under `ns`: each payload's checksum is
        computed here and each header written here, then the blocks are
        published. Returns how many were new to the top tier."""
        pool, size = self.shared_pool(), object_size(ns)
        assert pool is not None and len(keys) == len(slots)
        try:
            table = pool.rows.numpy()
            sums = [payload_checksum(table[s, :size]) for s in slots]
            idx = torch.tensor(list(slots), dtype=torch.long)
            pool.rows[:, :HEADER_SIZE].index_copy_(0, idx, headers(ns, keys, sums))
        except BaseException:
            pool.unreserve(slots)
            raise
        with self._locks[0]:
            done = pool.publish(keys, slots, size)
            new = [(k, pool.rows[s, :size]) for k, s, ok in zip(keys, slots, done) if ok]
            for k, _ in new:
                self.policies[0].insert(k)
        self._publish(0, [k for k, _ in new])
        for i in range(1, len(self.tiers)):  # writers hold objects past this call, and slots get reused
            if self.modes[i] == "through":
                self._submit(i, [(k, obj.clone()) for k, obj in new if not self._below_has(i, k)])
        return len(new)

    def unreserve(self, slots: Sequence[int]) -> None:
        """Hand back reserved slots that will not be committed."""
        if slots:
            self.shared_pool().unreserve(slots)
