"""The shared-pool store: a same-host client writes block objects straight
into the daemon's host pool (cache_service/store/shared_slots.py), on the same-host socket (cache_service/server/socket_server.py).

A client segment (cache_service/protocol/segment.py) makes a store cost two copies and
two hash passes: the client encodes into its segment, the daemon checks the
objects and copies them into its pool. When the top tier is a shared pool
(`[tiers.cpu] shared`, on under `tierkv serve`), three same-host socket ops make it
one copy, hashed while in cache:

- MAP_POOL (PoolRequest) -> PoolReply and, passed over the Unix socket, the
  pool's memfd, which the client maps read-write. Refused unless the daemon
  serves a single tenant: every mapping sees the whole pool.
- RESERVE (BlocksRequest) -> ReserveReply: a free slot per block (room is
  made as a put makes it), or held / no room. The slots are the
  connection's lease, at most a request's worth (`max_request_bytes`) at a
  time: whatever it has not committed when it ends (the client closed it,
  or died) goes back to the free list.
- COMMIT (CommitRequest) -> CommitReply: the client wrote each block's
  object into its slot; the daemon checks the headers and publishes the
  blocks. Only slots this connection reserved, for the same blocks (or as
  spares), are accepted, and a slot whose header is not its block's (never
  written) fails the call. A Commit may ask for spare slots, leased like
  the others but for no block yet: the client's next store fills them at
  once instead of waiting for a Reserve (after idling, a same-host socket round trip
  costs 0.4 ms here where it costs 0.05 ms back to back).

Loads read the pool in place: HOLD (BlocksRequest) -> HoldReply gives the
slot of each block the pool holds, kept from reuse (even once evicted)
until LET_GO or the connection ends; the client verifies each object where
it lies (header and payload checksum) and writes the payloads on (into an
engine's pages): no copy into its segment first.

Why this is safe enough to be on by default: one tenant only (another
tenant's blocks are never mapped), the pool is verified on every load (a
scribbled payload is a miss, not a wrong answer), and a slot is written only
between its reservation and its commit, by the client whose connection
holds it (and at the commit by the daemon, which rewrites headers for a
tenant's keys). A hash repeated within a Reserve gets "no room" the second
time.
"""
from __future__ import annotations

import os
import threading

import grpc

from cache_service.protocol.ops import Op
from cache_service.protocol.socket_server import Connection
from cache_service.blocks.objects import object_size
from cache_service.protocol.messages import RequestError, hashes_from_pb, invalid, ns_from_pb, parse
from proto import tierkv_pb2 as pb
from tiers.types import BlockHash, CapacityError, CorruptBlockError


class Lease:
    """The slots one same-host socket connection has reserved and not yet committed."""

    def __init__(self, store) -> None:
        self.store = store
        self.slots: dict[int, BlockHash | None] = {}  # slot -> the store key it was reserved for (None: spare)
        self._lock = threading.Lock()

    def add(self, keys: list[BlockHash | None], slots: list[int]) -> None:
        with self._lock:
            self.slots.update((s, k) for k, s in zip(keys, slots) if s >= 0)

    def spares(self) -> int:
        with self._lock:
            return sum(k is None for k in self.slots.values())

    def take(self, keys: list[BlockHash], slots: list[int]) -> None:
        """Remove `slots` from the lease; INVALID_ARGUMENT (taking none) unless
        each was reserved here for the key beside it, or as a spare."""
        with self._lock:
            wrong = next((j for j, (k, s) in enumerate(zip(keys, slots))
                          if s not in self.slots or self.slots[s] not in (k, None)), None)
            if wrong is None and len(set(slots)) == len(slots):
                spares = sum(self.slots.pop(s) is None for s in slots)
                self.store.spares_done(spares)
                return
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Commit: slot {slots[wrong] if wrong is not None else '(repeated)'} is not one this "
                           f"connection reserved for that block")

    def release(self) -> None:
        with self._lock:
            slots, self.slots = self.slots, {}
        self.store.unreserve(list(slots))
        self.store.spares_done(sum(k is None for k in slots.values()))


def _kept(servicer, conn: Connection, kind: type):
    """The connection's Lease (or Holds), made on first use, released when the connection ends."""
    kept = conn.kept.get(kind.__name__)
    if kept is None:
        kept = conn.kept[kind.__name__] = kind(servicer.store)
        conn.on_close.append(kept.release)
    return kept


def _pool(servicer):
    pool = servicer.store.shared_pool()
    if pool is None:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "the daemon's top tier is not a shared pool")
    if servicer.auth.tenant_count() > 1:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           "the daemon serves several tenants: its pool is not shared")
    return pool


def map_pool(servicer, conn: Connection, body: bytes, tenant: str | None):
    """MAP_POOL: the pool's geometry, its memfd attached to the reply."""
    request = parse(pb.PoolRequest, body, "MapPool")
    pool = _pool(servicer)
    ns, _ = servicer._blocks(pb.BlocksRequest(ns=request.ns), tenant)
    try:  # sizes a pool still waiting for its first block; a sized one says how big its slots are
        pool.reserve([], object_size(ns))
    except CapacityError:  # this namespace's objects do not fit: the client sees it in slot_bytes
        pass
    conn.fds = [os.dup(pool.share_fd)]  # ours to close once sent, whatever happens to the pool meanwhile
    return pb.PoolReply(slot_bytes=pool.slot_bytes, slot_stride=pool.slot_stride, num_slots=pool.num_slots), []


def reserve(servicer, conn: Connection, body: bytes, tenant: str | None):
    """RESERVE: a slot (or held / no room) per block, leased to this connection."""
    request = parse(pb.BlocksRequest, body, "Reserve")
    _pool(servicer)
    ns, keys = servicer._blocks(request, tenant)
    lease = _kept(servicer, conn, Lease)
    held = len(lease.slots)  # a client may hold a request's worth of slots at a time, not the whole pool
    if (held + len(keys)) * ns.payload_bytes > servicer.s.max_request_bytes:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"Reserve: {held} slots reserved and not committed here; {len(keys)} more would pass "
                           f"the daemon's {servicer.s.max_request_bytes}-byte limit per request (commit first)")
    slots = servicer.store.reserve(ns, keys)
    lease.add(keys, slots)
    return pb.ReserveReply(slots=slots), []


def commit(servicer, conn: Connection, body: bytes, tenant: str | None):
    """COMMIT: publish leased slots the client has written."""
    request = parse(pb.CommitRequest, body, "Commit")
    _pool(servicer)
    ns, keys = servicer._blocks(request, tenant)
    slots = list(request.slots)
    if len(slots) != len(keys):
        raise invalid(f"Commit: {len(slots)} slots for {len(keys)} hashes")
    lease = _kept(servicer, conn, Lease)
    lease.take(keys, slots)
    sent_ns, sent = ns_from_pb(request.ns), hashes_from_pb(request.hashes, servicer.s.max_blocks)
    try:
        stored = servicer.store.commit(sent_ns, sent, ns, keys, slots)
    except (CorruptBlockError, CapacityError) as e:
        raise invalid(f"Commit: bad block object in the shared pool ({e})") from None
    servicer.metrics.moved(tenant, "store", len(keys) * ns.payload_bytes)
    # spares count against the lease's limit, and a client holds at most spare_limit of them
    room = min(servicer.s.max_request_bytes // ns.payload_bytes - len(lease.slots),
               servicer.store.spare_limit(ns) - lease.spares())
    spare = servicer.store.reserve_spare(ns, min(request.spare, room)) if request.spare and room > 0 else []
    lease.add([None] * len(spare), spare)
    return pb.CommitReply(stored=stored, spare=spare), []


class Holds:
    """The pool slots one same-host socket connection holds for reading in place."""

    def __init__(self, store) -> None:
        self.store = store
        self.slots: dict[int, list] = {}  # slot -> its hold entries (a slot may be held more than once)
        self._lock = threading.Lock()

    def count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self.slots.values())

    def add(self, held: list) -> None:
        with self._lock:
            for entry in filter(None, held):
                self.slots.setdefault(entry[0], []).append(entry)

    def take(self, slots: list[int]) -> list:
        """One hold per slot, removed; INVALID_ARGUMENT (taking none) for a slot not held here."""
        with self._lock:
            need: dict[int, int] = {}
            for s in slots:
                need[s] = need.get(s, 0) + 1
            wrong = next((s for s, n in need.items() if len(self.slots.get(s, ())) < n), None)
            if wrong is None:
                return [self._pop(s) for s in slots]
        raise invalid(f"LetGo: slot {wrong} is not held by this connection")

    def _pop(self, slot: int):
        entries = self.slots[slot]
        entry = entries.pop()
        if not entries:
            del self.slots[slot]
        return entry

    def release(self) -> None:
        with self._lock:
            held, self.slots = [e for v in self.slots.values() for e in v], {}
        self.store.let_go(held)


def hold(servicer, conn: Connection, body: bytes, tenant: str | None):
    """HOLD: the slot of each block the pool holds (-1 not there), kept from reuse until LET_GO."""
    request = parse(pb.BlocksRequest, body, "Hold")
    _pool(servicer)
    ns, keys = servicer._blocks(request, tenant)
    holds = _kept(servicer, conn, Holds)
    if (holds.count() + len(keys)) * ns.payload_bytes > servicer.s.max_request_bytes:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"Hold: {holds.count()} slots held here; {len(keys)} more would pass the daemon's "
                           f"{servicer.s.max_request_bytes}-byte limit per request (let go first)")
    held = servicer.store.hold(keys)
    holds.add(held)
    servicer.metrics.moved(tenant, "load", ns.payload_bytes * sum(e is not None for e in held))
    return pb.HoldReply(slots=[e[0] if e is not None else -1 for e in held]), []


def let_go(servicer, conn: Connection, body: bytes, tenant: str | None):
    """LET_GO: slots this connection held go back."""
    request = parse(pb.LetGoRequest, body, "LetGo")
    servicer.store.let_go(_kept(servicer, conn, Holds).take(list(request.slots)))
    return pb.LetGoReply(), []


HANDLERS = {Op.MAP_POOL: map_pool, Op.RESERVE: reserve, Op.COMMIT: commit, Op.HOLD: hold, Op.LET_GO: let_go}
