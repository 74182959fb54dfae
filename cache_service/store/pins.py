"""Pins: blocks kept out of eviction, in every tier, while a pin covers them.

Two kinds: a block pin (`pin(hashes, until)`, the daemon's Pin call) and a
session pin (`pin_session`): one per (tenant, session), over the blocks of
that conversation, replaced as the conversation grows and released as one.
A block stays pinned while any pin covers it, so a sub-agent forked from its
parent's prefix shares the parent's pinned blocks (no copy) and pins its
own tail on top.

Pins are bounded per tenant: the bytes of a tenant's distinct
session-pinned blocks stay under `cap_bytes`; past it the tenant's oldest
session pin yields (counted as ``pins_yielded`` and logged), and the pin
that asked still holds, so the request that made it succeeds. A tenant's
block pins stay under `cap_bytes` too, its oldest block pins yielding, those
of the asking call included. A block counts for at least the store's typical
stored block (`typical_bytes`), whatever size the caller claims, and expired
block pins are swept as session pins are, asked about or not.
"""
from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from tiers.types import BlockHash

log = logging.getLogger("tierkv.pins")
EXPIRY_CHECK_S = 1.0  # expired session pins are swept at most this often (block pins: as they expire)


@dataclass(slots=True)
class SessionPin:
    hashes: tuple[BlockHash, ...]
    until: float  # monotonic deadline (inf: until released)
    block_bytes: int


class PinBook:
    """All pins of one store; thread-safe, no I/O under its lock."""

    def __init__(self, cap_bytes: int = 0, typical_bytes: Callable[[], int] = lambda: 0) -> None:
        """`cap_bytes`: a tenant's session-pinned bytes at most, and its block-pinned
        bytes (0: no cap); `typical_bytes`: what a stored block takes (the floor of a block's count)."""
        self.cap_bytes, self.typical_bytes = cap_bytes, typical_bytes
        self._lock = threading.Lock()
        self._blocks: dict[BlockHash, float] = {}  # block pins: hash -> monotonic deadline
        self._deadlines: list[tuple[float, BlockHash]] = []  # a heap of the finite ones (some stale)
        self._block_owner: dict[BlockHash, str] = {}  # the tenant whose count a block pin is in
        self._tenant_blocks: dict[str, OrderedDict[BlockHash, int]] = {}  # oldest first, with their bytes
        self._block_bytes: Counter[str] = Counter()
        self._sessions: OrderedDict[tuple[str, str], SessionPin] = OrderedDict()  # oldest first
        self._refs: Counter[BlockHash] = Counter()  # hash -> session pins covering it
        self._tenant_refs: dict[str, Counter[BlockHash]] = {}
        self._tenant_sizes: dict[str, dict[BlockHash, int]] = {}  # the bytes each block counts for its tenant
        self._tenant_bytes: Counter[str] = Counter()
        self._next_expiry_check = 0.0
        self._warned: dict[str, float] = {}
        self.yielded = 0

    # ------------------------------------------------------------- block pins
    def pin(self, hashes: Sequence[BlockHash], ttl_s: float | None = None, tenant: str = "") -> int:
        """Pin blocks for `ttl_s` seconds (None: until `unpin`), counted for
        `tenant`; returns how many of its block pins yielded to the cap."""
        now = time.monotonic()
        until = math.inf if ttl_s is None else now + ttl_s
        size = max(1, self.typical_bytes())
        with self._lock:
            self._expire(now)
            mine = self._tenant_blocks.setdefault(tenant, OrderedDict())
            for h in hashes:
                if until > self._blocks.get(h, 0.0):
                    self._blocks[h] = until
                    if until != math.inf:
                        heapq.heappush(self._deadlines, (until, h))
                if self._block_owner.get(h, tenant) != tenant:
                    self._uncount(h)
                if h not in mine:
                    mine[h] = size
                    self._block_bytes[tenant] += size
                    self._block_owner[h] = tenant
                mine.move_to_end(h)
            self._compact()
            yielded = 0
            while self.cap_bytes and self._block_bytes[tenant] > self.cap_bytes:
                self._unpin_block(next(iter(mine)))
                yielded += 1
            if yielded:
                self.yielded += yielded
                if now >= self._warned.get(tenant, 0.0):  # a tenant pinning at its cap: a line a minute
                    self._warned[tenant] = now + 60.0
                    log.warning("tenant %r over its pin cap of %d bytes: its oldest block pins yield (counted "
                                "in pins_yielded)", tenant, self.cap_bytes)
            return yielded

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Drop the block pins of `hashes` (session pins covering them stay)."""
        with self._lock:
            for h in hashes:
                self._unpin_block(h)
            self._compact()

    def _compact(self) -> None:
        """Drop the deadlines that extended or dropped pins left behind, once they outnumber the pins."""
        if len(self._deadlines) > 2 * len(self._blocks) + 64:
            self._deadlines = [(u, h) for h, u in self._blocks.items() if u != math.inf]
            heapq.heapify(self._deadlines)

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Blocks deleted from the store: no block pin survives them."""
        self.unpin(hashes)

    def _unpin_block(self, h: BlockHash) -> None:
        if self._blocks.pop(h, None) is not None:
            self._uncount(h)

    def _uncount(self, h: BlockHash) -> None:
        owner = self._block_owner.pop(h)
        self._block_bytes[owner] -= self._tenant_blocks[owner].pop(h)

    # ----------------------------------------------------------- session pins
    def pin_session(self, tenant: str, session: str, hashes: Sequence[BlockHash], ttl_s: float | None,
                    block_bytes: int) -> list[str]:
        """Pin (or re-pin, replacing the earlier pin) a session's blocks for
        `ttl_s` seconds (None: until released). Returns the ids of the
        tenant's sessions whose pins yielded to the cap."""
        now = time.monotonic()
        until = math.inf if ttl_s is None else now + ttl_s
        block_bytes = max(block_bytes, self.typical_bytes())  # a caller's namespace cannot make its blocks small
        with self._lock:
            self._expire(now, force=True)  # an expired pin's bytes must not push a live one out past the cap
            self._drop((tenant, session))
            self._sessions[(tenant, session)] = SessionPin(tuple(hashes), until, block_bytes)
            self._add_refs(tenant, hashes, block_bytes)
            return self._enforce_cap(tenant, keep=(tenant, session))

    def unpin_session(self, tenant: str, session: str) -> bool:
        """Release a session's pin; False when it had none."""
        with self._lock:
            return self._drop((tenant, session))

    def session_pins(self, tenant: str) -> dict[str, int]:
        """Session id -> blocks pinned, for a tenant's live session pins."""
        with self._lock:
            self._expire(time.monotonic(), force=True)
            return {s: len(p.hashes) for (t, s), p in self._sessions.items() if t == tenant}

    # ------------------------------------------------------------------ query
    def any(self) -> bool:
        """Whether any pin may be live (False: no block is pinned, none need be asked about)."""
        with self._lock:
            return bool(self._blocks or self._refs)

    def is_pinned(self, h: BlockHash) -> bool:
        """Whether any live pin covers `h` (expired pins are dropped here)."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)  # every finite block pin has its deadline in the heap: none expired is left
            return h in self._blocks or self._refs[h] > 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._expire(time.monotonic(), force=True)
            both = sum(h in self._blocks for h in self._refs)  # session refs are few beside block pins
            return {"pinned_blocks": len(self._blocks) + len(self._refs) - both, "session_pins": len(self._sessions),
                    "session_pinned_bytes": sum(self._tenant_bytes.values()), "pins_yielded": self.yielded}

    # --------------------------------------------------------------- internal
    def _add_refs(self, tenant: str, hashes: Sequence[BlockHash], block_bytes: int) -> None:
        refs = self._tenant_refs.setdefault(tenant, Counter())
        sizes = self._tenant_sizes.setdefault(tenant, {})
        for h in set(hashes):
            self._refs[h] += 1
            refs[h] += 1
            if refs[h] == 1:
                sizes[h] = block_bytes
                self._tenant_bytes[tenant] += block_bytes

    def _drop(self, key: tuple[str, str]) -> bool:
        pin = self._sessions.pop(key, None)
        if pin is None:
            return False
        refs = self._tenant_refs[key[0]]
        for h in set(pin.hashes):
            self._refs[h] -= 1
            if self._refs[h] <= 0:
                del self._refs[h]
            refs[h] -= 1
            if refs[h] <= 0:
                del refs[h]
                self._tenant_bytes[key[0]] -= self._tenant_sizes[key[0]].pop(h)  # what it counted for
        return True

    def _enforce_cap(self, tenant: str, keep: tuple[str, str]) -> list[str]:
        yielded = []
        while self.cap_bytes and self._tenant_bytes[tenant] > self.cap_bytes:
            oldest = next((k for k in self._sessions if k[0] == tenant and k != keep), None)
            if oldest is None:
                break  # the asking session alone is over the cap: it still holds
            self._drop(oldest)
            yielded.append(oldest[1])
        if yielded:
            self.yielded += len(yielded)
            log.warning("tenant %r over its pin cap of %d bytes: pins of sessions %s yielded", tenant,
                        self.cap_bytes, ", ".join(yielded))
        return yielded

    def _expire(self, now: float, force: bool = False) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:  # block pins nobody asks about leave too,
            until, h = heapq.heappop(self._deadlines)  # in deadline order: no walk over every pin
            if self._blocks.get(h) == until:  # (not extended by a later pin, nor gone already)
                self._unpin_block(h)
        if not force and now < self._next_expiry_check:
            return
        self._next_expiry_check = now + EXPIRY_CHECK_S
        for key in [k for k, p in self._sessions.items() if p.until <= now]:
            self._drop(key)
