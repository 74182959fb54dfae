"""The TCP data path: Load and Store as raw bytes over a TCP socket.

gRPC's Python stack moves 1 MiB messages at 0.06-0.09 x memcpy on this
kind of machine with no work on either side, a third of what a bare
loopback socket does (docs/benchmarks.md). So the daemon also serves the
two bulk calls on a plain TCP port (`HelloReply.data_port`, on the gRPC
listen address), with the same-host socket's frames, HELLO token check, tenants,
status codes and metrics (cache_service/server/socket_server.py):

- LOAD: frame(LOAD, LoadRequest) -> frame(OK, LoadShmReply sizes), then the
  object (header + payload) of each hit back to back, headed for the
  namespace and hashes the client sent. The client reads them into one
  buffer and checks every header and checksum in place; a block failing
  them is a miss.
- STORE: frame(STORE, StoreChunk with ns and hashes), then every block's
  object back to back -> frame(OK, StoreReply). The daemon reads them into
  one buffer, checks each in full, stores them, and stores nothing if one
  is bad. An error found before the bytes were read closes the connection
  after its reply (the stream is out of step).

Calls carry at most `HelloReply.data_batch_bytes` of objects; the client
splits bigger ones. The data path is plain TCP, so a daemon serving TLS does not
open it; clients then stream through gRPC.
"""
from __future__ import annotations

import logging

import grpc
import torch

from cache_service.protocol.ops import Op
from cache_service.protocol.socket_server import Connection
from cache_service.blocks.keys import Namespace
from cache_service.protocol.streaming import object_pieces
from cache_service.blocks.objects import HEADER_SIZE, checksum, object_size, rehead, require
from cache_service.protocol.batches import per_bytes, split
from cache_service.protocol.messages import RequestError, hashes_from_pb, invalid, ns_from_pb, parse
from proto import tierkv_pb2 as pb
from tiers.host_copy import copy_hashed
from tiers.types import BlockHash, CorruptBlockError

log = logging.getLogger("tierkv.server")
GROUP_BYTES = 8 << 20


def _bounded(servicer, n: int, ns: Namespace) -> int:
    """Object bytes of n blocks; RESOURCE_EXHAUSTED past the data path's batch size."""
    total = n * object_size(ns)
    if total > servicer.s.load_batch_bytes:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{n} block objects of {object_size(ns)} bytes exceed the data path's "
                           f"{servicer.s.load_batch_bytes}-byte batch; split the call")
    return total


def _groups(n: int, object_bytes: int) -> list[range]:
    """A call's blocks in groups of about GROUP_BYTES: one group is read,
    checked or sent while the other side works on the one before."""
    return split(n, per_bytes(GROUP_BYTES, object_bytes))


def _announced_bytes(head: pb.StoreChunk) -> int | None:
    """The object bytes a STORE frame says follow it, if its namespace parses."""
    try:
        return len(head.hashes) * object_size(ns_from_pb(head.ns))
    except Exception:  # a namespace that does not parse: the size is unknown
        return None


def serve_load(servicer, conn: Connection, body: bytes, tenant: str | None):
    """LOAD, group by group: (sizes, the hits' objects as the client named them)."""
    request = parse(pb.LoadRequest, body, "Load")
    ns, keys = servicer._blocks(request, tenant)
    _bounded(servicer, len(keys), ns)
    sent_ns, sent = ns_from_pb(request.ns), hashes_from_pb(request.hashes, servicer.s.max_blocks)
    S, P = object_size(ns), ns.payload_bytes
    if not keys:
        return pb.LoadShmReply(), []
    rows = conn.arena.matrix(len(keys), S)
    objs = memoryview(rows.numpy()).cast("B")
    last: tuple = (pb.LoadShmReply(), [])
    for k, r in enumerate(_groups(len(keys), S)):
        if k:
            conn.send_part(*last)
        hits = servicer.store.load_into(ns, keys[r.start:r.stop], rows[r.start:r.stop])
        # headed as the client named them (a tenant's keys are salted); None for a miss
        found = [object_pieces(objs[j * S:(j + 1) * S], ns, keys[j], sent_ns, sent[j]) if hit else None
                 for j, hit in zip(r, hits)]
        servicer.metrics.moved(tenant, "load", P * sum(f is not None for f in found))
        last = (pb.LoadShmReply(sizes=[P if f is not None else 0 for f in found]),
                [piece for f in found if f is not None for piece in f])
    return last


def serve_store(servicer, conn: Connection, body: bytes, tenant: str | None):
    """STORE: read the objects that follow group by group, checking each group
    while the client sends the next; store them all, or nothing if one is bad."""
    conn.unread = True  # until the objects are read, an error leaves them in the stream
    head = parse(pb.StoreChunk, body, "Store")
    try:
        ns, keys = servicer._blocks(head, tenant)
        _bounded(servicer, len(keys), ns)
        total = servicer._check_request_bytes(len(keys), ns)
    except RequestError:  # refused before reading: drop the objects that follow when their size is known and sane
        follows = _announced_bytes(head)
        if follows is not None and follows <= servicer.s.load_batch_bytes:
            conn.discard(follows)
        raise
    sent_ns, sent = ns_from_pb(head.ns), hashes_from_pb(head.hashes, servicer.s.max_blocks)
    rows = conn.arena.matrix(len(keys), object_size(ns))
    into = _Slots(servicer.store, ns, keys)
    try:
        sums = _read_checked(conn, rows, sent_ns, sent, into)
        if (sent_ns, sent) != (ns, keys):
            rehead(rows, ns, keys, sums)
        stored = into.commit(sums) + servicer.store.store_objects(
            ns, [keys[j] for j in into.others], [rows[j] for j in into.others], verify=False)
    except BaseException:
        into.give_back()
        raise
    servicer.metrics.moved(tenant, "store", total)
    return pb.StoreReply(stored=stored), []


def _read_checked(conn: Connection, rows: torch.Tensor, sent_ns: Namespace, sent: list[BlockHash],
                  into: "_Slots") -> list[int]:
    """Read a STORE's objects into `rows` group by group, checking each group
    (and copying it into its pool slots, `_Slots`) while the client sends the
    next; every object is read even after a bad one, so the connection stays
    in step. Their payload checksums, or INVALID_ARGUMENT."""
    sums: list[int] = []
    bad: CorruptBlockError | None = None
    for r in _groups(len(sent), rows.shape[1]):
        conn.read_into(memoryview(rows[r.start:r.stop].numpy()).cast("B"))
        try:
            if bad is None:
                sums += require(rows[r.start:r.stop], sent_ns, sent[r.start:r.stop], into.copy(rows, r))
        except CorruptBlockError as e:
            bad = e
    conn.unread = False
    if bad is not None:
        raise invalid(f"Store: bad block object ({bad})")
    return sums


class _Slots:
    """Where a data path STORE's objects go when the top tier is a shared pool:
    slots reserved up front, each object copied into its slot as its group
    arrives (hashed in the same pass: that is the check), the lot published
    at the end. Without a shared pool, or for blocks that get no slot, the
    store's usual put (`others`)."""

    def __init__(self, store, ns: Namespace, keys: list[BlockHash]) -> None:
        self.store, self.ns, self.keys = store, ns, keys
        self.pool = store.shared_pool()
        self.slots = store.reserve(ns, keys) if self.pool is not None else [-2] * len(keys)
        self.others = [j for j, s in enumerate(self.slots) if s == -2]  # no room: the usual put

    def copy(self, rows: torch.Tensor, r: range) -> list[int] | None:
        """The payload checksums of rows[r], each row with a slot copied into it
        as it is hashed; None (hash them in place) when no row has one."""
        if self.pool is None or all(self.slots[j] < 0 for j in r):
            return None
        size, table, src = rows.shape[1], self.pool.rows.numpy(), rows.numpy()
        mine = [j for j in r if self.slots[j] >= 0]
        copied = dict(zip(mine, copy_hashed([table[self.slots[j], HEADER_SIZE:size] for j in mine],
                                            [src[j, HEADER_SIZE:] for j in mine])))
        return [copied[j] if j in copied else checksum(rows[j, HEADER_SIZE:]) for j in r]

    def commit(self, sums: list[int]) -> int:
        """Head the copied objects (with the store's keys) and publish them."""
        mine = [j for j, s in enumerate(self.slots) if s >= 0]
        if not mine:
            return 0
        ks, ss = [self.keys[j] for j in mine], [self.slots[j] for j in mine]
        rehead(self.pool.rows, self.ns, ks, [sums[j] for j in mine], at=ss)
        self.slots = [-1] * len(self.keys)  # the store's now, published or handed back by commit
        return self.store.commit(self.ns, ks, self.ns, ks, ss)

    def give_back(self) -> None:
        self.store.unreserve([s for s in self.slots if s >= 0])
        self.slots = [-1] * len(self.keys)


HANDLERS = {Op.LOAD: serve_load, Op.STORE: serve_store}
