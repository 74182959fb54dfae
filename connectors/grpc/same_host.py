"""The same-host paths of a `GrpcClient`: its shared-memory segment, the
daemon's same-host socket and, when the daemon shares it, the daemon's host pool.

- Loads: blocks in the daemon's pool are read where they lie (HOLD, then
  verified in place; server/pool.py); the daemon copies the others into
  this client's segment and verifies them there (LoadShm).
- Stores: into the daemon's pool when it offers it (server/pool.py):
  Reserve slots, encode each block's object straight into its slot (the
  payload copied and hashed in one pass), Commit; in chunks, so the daemon
  checks one while this process fills the next. Else, or for blocks the pool has no
  room for, encoded into the segment and checked and copied by the daemon
  (StoreShm).

Calls go over the same-host socket when the daemon offered one
(AttachReply.socket_path), else through gRPC; the pool needs the socket (its
memfd is passed over it). A failure drops the segment, the socket and the pool
mapping (the daemon then hands back any slots still reserved); a later call
attaches anew.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import grpc
import torch

from cache_service.protocol.batches import split
from cache_service.protocol.ops import SPECS, Op
from cache_service.protocol.socket_client import SocketCallError, SocketClient
from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import (HEADER_SIZE, checksums, encode_flats, encode_rows, object_size,
                                          payload_bytes, verify)
from cache_service.protocol.segment import Segment
from cache_service.protocol.messages import torch_dtype
from proto import tierkv_pb2 as pb
from connectors.grpc.pool_map import NO_ROOM, PoolMap, PoolReplies, ProtocolError, checked_slots, map_pool, ns_pb
from tiers.arena import can_count_users, storage_users
from tiers.types import BlockHash

CHUNK_BYTES = 16 << 20  # a pool store's unit: the daemon commits one while the client fills the next


class SameHost:
    """One client's segment, same-host socket and pool mapping (callers hold `lock`).

    It gets what it needs of its client as functions: `call(name, request,
    timeout_s=None)` (a unary gRPC call), `store_stream(ns, hashes, payloads)`
    (the streamed store, for blocks neither the pool nor the segment takes)
    and `on_transport("shm" | "stream")` (told when shared memory comes or goes)."""

    def __init__(self, call: Callable, store_stream: Callable, on_transport: Callable[[str], None],
                 token: str | None, timeout_s: float, nbytes: int, pool_loads: bool = False) -> None:
        self.grpc_call, self.store_stream, self.on_transport = call, store_stream, on_transport
        self.token, self.timeout_s, self.nbytes = token, timeout_s, nbytes
        self.seg: Segment | None = None
        self.attachment = ""
        self.socket: SocketClient | None = None
        self.pool: PoolMap | None = None
        self.pool_refused = False  # the daemon does not share its pool (asked once per socket connection)
        self.spare: list[int] = []  # pool slots leased to this socket connection for no block yet
        self.pool_loads = pool_loads  # read held blocks in the pool (objects headed as this client names them)
        self._held: list[tuple[torch.Tensor, list[int]]] = []  # (handle of the loaded views, pool slots they hold)
        self._retired: list[tuple[SocketClient, list]] = []  # dropped connections whose holds a caller still reads
        self.retry_at = 0.0
        self.lock = threading.Lock()

    def attach(self) -> None:
        seg = Segment(self.nbytes)
        try:
            reply = self.grpc_call("Attach", pb.AttachRequest(name=seg.name, nonce=seg.nonce))
        except BaseException:
            seg.close()
            raise
        seg.unlink()  # the daemon maps it now; no name left behind if anyone dies
        self.seg, self.attachment = seg, reply.attachment
        self.socket = SocketClient.open(reply.socket_path, self.token, self.timeout_s) if reply.socket_path else None

    def close_socket(self) -> None:
        """Hang up the same-host socket; the pool mapping goes with it (the
        daemon hands back its slots). A connection whose held pool slots back
        payloads a caller still reads stays open, retired, until those are
        dropped (`_let_go`): the daemon would reuse the slots under them."""
        sock, self.socket, self.pool, self.pool_refused, self.spare = self.socket, None, None, False, []
        live = [(handle, slots) for handle, slots in self._held if storage_users(handle) > 1]
        self._held = []
        if sock is not None and live:
            self._retired.append((sock, live))
        elif sock is not None:
            sock.close()
        self._close_retired()

    def _close_retired(self, every: bool = False) -> None:
        """Hang up retired connections whose loaded payloads nobody holds any more (`every`: all of them)."""
        keep = []
        for sock, held in self._retired:
            if every or all(storage_users(handle) <= 1 for handle, _ in held):
                sock.close()
            else:
                keep.append((sock, held))
        self._retired = keep

    def drop(self) -> None:
        """Stop using the segment: the daemon forgot it (restart) or may still
        be writing into it (a call that timed out). A new one is attached on
        a later call (`segment`)."""
        with self.lock:
            self._drop()

    def _drop(self) -> None:
        old, self.seg = self.seg, None
        self.close_socket()
        if old is not None:
            # the daemon lets go of it now, not when it reaps idle ones: its attachments are few, and shared
            threading.Thread(target=self._detach, args=(self.attachment,), name="tierkv-detach", daemon=True).start()
            old.close()
            self.retry_at = time.monotonic()
            self.on_transport("stream")

    def segment(self) -> Segment | None:
        """The attached segment; re-attaches a dropped one, at most every 10 s."""
        if self.seg is None and self.nbytes and time.monotonic() >= self.retry_at:
            with self.lock:
                if self.seg is None:
                    try:
                        self.attach()
                        self.on_transport("shm")
                    except (OSError, grpc.RpcError):
                        self.retry_at = time.monotonic() + 10.0
        return self.seg

    def room(self, ns: Namespace) -> int:
        """Bytes of the segment when it can carry this namespace's blocks, else 0."""
        seg = self.segment()
        return seg.data_bytes if seg is not None and object_size(ns) <= seg.data_bytes else 0

    def call(self, op: Op, request):
        """A shared-memory call (caller holds `lock`): on the same-host socket
        when the daemon offered one, else through gRPC."""
        return self.socket.call(op, request) if self.socket is not None else self.grpc_call(SPECS[op].method, request)

    def close(self) -> None:
        self.nbytes = 0  # no re-attaching after this
        seg, self.seg = self.seg, None
        self.close_socket()
        self._close_retired(every=True)  # closing the client ends its loans, as its docstring says
        if seg is not None:
            self._detach(self.attachment)
            seg.close()

    def _detach(self, attachment: str) -> None:
        """Best effort: a call that timed out may still write into the segment
        in the daemon, which holds its own mapping of it for that call."""
        try:
            self.grpc_call("Detach", pb.DetachRequest(attachment=attachment), timeout_s=2.0)
        except grpc.RpcError:
            pass  # forgotten already (a restart), or unreachable: the daemon reaps idle attachments itself

    # ------------------------------------------------------------ data paths
    def load(self, ns: Namespace, hashes: Sequence[BlockHash], lend: bool) -> list[torch.Tensor | None] | None:
        """Verified payloads per hash (None: a miss). With `lend` (views are
        fine) the blocks the daemon's pool holds are read in place there
        (`_load_pool`); the others land in the segment. None: no segment, or
        no room in it (the caller streams)."""
        with self.lock:
            if self.seg is None:  # lost meanwhile (see drop)
                return None
            self._let_go()
            pool = self._pool(ns) if lend and self.pool_loads and can_count_users() else None
            out = self._load_pool(pool, ns, hashes) if pool is not None else [None] * len(hashes)
            todo = [j for j, p in enumerate(out) if p is None]
            rest = self._load_segment(ns, [hashes[j] for j in todo], lend) if todo else []
            if rest is None and len(todo) == len(hashes):
                return None
            for j, p in zip(todo, rest or []):
                out[j] = p
            return out

    def _load_pool(self, pool: PoolMap, ns: Namespace, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """The blocks the daemon's pool holds, read where they lie: HOLD, then
        each object verified in place (header and payload checksum; a bad one
        is a miss here, which the segment path reads again and the daemon
        quarantines). The payloads are views that keep their slots held;
        `_let_go` hands back those nobody uses any more."""
        try:
            reply = self.call(Op.HOLD, pb.BlocksRequest(ns=ns_pb(ns), hashes=list(hashes)))
        except SocketCallError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # too many still held: the segment it is
                raise
            return [None] * len(hashes)
        num = pool.rows.shape[0]
        slots = checked_slots("Hold", list(reply.slots), len(hashes), -1, num)
        hit = [j for j, s in enumerate(slots) if s >= 0]
        held = [slots[j] for j in hit]
        handle = torch.frombuffer(pool.mm, dtype=torch.uint8)  # its storage's use count tells when views are gone
        rows = handle.view(num, pool.stride)[:, HEADER_SIZE:object_size(ns)].view(torch_dtype(ns))
        views = [rows.view(num, *ns.block_shape)[s] for s in held]
        heads = pool.rows[:, :HEADER_SIZE].index_select(0, torch.tensor(held, dtype=torch.int64))  # one pass
        sums = verify(heads, ns, [hashes[j] for j in hit], checksums(views))  # payloads hashed where they lie
        good = {j: view for j, view, csum in zip(hit, views, sums) if csum is not None}
        self._held.append((handle, held))
        return [good.get(j) for j in range(len(hashes))]

    def _let_go(self) -> None:
        """Hand back the pool slots of earlier loads whose payloads nobody holds any more."""
        self._close_retired()
        done = [slots for handle, slots in self._held if storage_users(handle) <= 1]
        self._held = [(handle, slots) for handle, slots in self._held if storage_users(handle) > 1]
        if any(done) and self.socket is not None:
            self.call(Op.LET_GO, pb.LetGoRequest(slots=[s for group in done for s in group]))

    def _load_segment(self, ns: Namespace, hashes: Sequence[BlockHash], lend: bool) -> list[torch.Tensor | None] | None:
        """LoadShm: object i lands at i * object_size in a stretch of the segment, verified there by the
        daemon. With `lend` the payloads are views, the stretch reserved while one lives; else copies.
        None: no room in the segment."""
        P, S = ns.payload_bytes, object_size(ns)
        got = (self.seg.stretch(len(hashes) * S, lend=True) if lend else None)
        lent = got is not None
        got = got or self.seg.stretch(len(hashes) * S)
        if got is None:  # the caller still holds earlier blocks all over the segment
            return None
        offset, area = got
        req = pb.ShmRequest(ns=ns_pb(ns), hashes=list(hashes), attachment=self.attachment, offset=offset)
        sizes = list(self.call(Op.LOAD_SHM, req).sizes)
        _check_sizes(sizes, len(hashes), P)
        payloads = _payload_views(area, ns, len(hashes))
        if not lent:
            payloads = [p.clone() if s else p for p, s in zip(payloads, sizes)]
        return [p if s else None for p, s in zip(payloads, sizes)]

    def store(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> int | None:
        """Into the daemon's pool when it shares one, else through the segment;
        None when neither can take the batch now (the caller streams)."""
        with self.lock:
            pool = self._pool(ns)
            if pool is None:
                return self._store_segment(ns, hashes, payloads)
            try:
                stored, rest = self._store_pool(pool, ns, hashes, payloads)
            except BaseException:  # replies may be left unread: start afresh (the daemon frees the slots)
                self._drop()
                raise
            if rest:  # the pool is full of pinned blocks: the daemon places these below
                hs, ps = [hashes[j] for j in rest], [payloads[j] for j in rest]
                more = self._store_segment(ns, hs, ps)
                stored += self.store_stream(ns, hs, ps) if more is None else more
            return stored

    def _store_pool(self, pool: PoolMap, ns: Namespace, hashes: Sequence[BlockHash],
                    payloads: Sequence[torch.Tensor]) -> tuple[int, list[int]]:
        """Reserve, fill and commit in chunks of about CHUNK_BYTES, pipelined:
        the daemon reserves the next chunk and commits the last one while
        this process fills the current one. (stored, positions with no room)."""
        per = max(1, CHUNK_BYTES // object_size(ns))
        chunks = split(len(hashes), per, edge=per // 4)
        replies = PoolReplies(self.socket, pool.rows.shape[0])
        if self.spare:  # spare slots from an earlier Commit: the first chunk starts without a round trip
            k = min(len(self.spare), len(chunks[0]))
            chunks[:1] = [chunks[0][:k]] + ([chunks[0][k:]] if k < len(chunks[0]) else [])
            replies.reserved.append(self.spare[:k])
            del self.spare[:k]
        else:
            replies.reserve(ns, [hashes[j] for j in chunks[0]])
        flats = payload_bytes(ns, payloads)  # while the daemon, likely idle until now, wakes up and answers
        rest: list[int] = []
        for k, chunk in enumerate(chunks):
            if k + 1 < len(chunks):
                replies.reserve(ns, [hashes[j] for j in chunks[k + 1]])
            slots = replies.slots(k)
            todo = [(j, s) for j, s in zip(chunk, slots) if s >= 0]
            rest += [j for j, s in zip(chunk, slots) if s == NO_ROOM]
            if todo:
                hs, ss = [hashes[j] for j, _ in todo], [s for _, s in todo]
                pool.prepare(ss)
                encode_flats(pool.rows, ss, ns, hs, [flats[j] for j, _ in todo])
                # the first Commit asks for the next store's spares: the daemon makes room while this fills on
                replies.commit(ns, hs, ss, spare=0 if replies.asked else max(1, per // 4) - len(self.spare))
        stored = replies.finish()
        self.spare += replies.spare
        return stored, rest

    def _store_segment(self, ns: Namespace, hashes: Sequence[BlockHash],
                       payloads: Sequence[torch.Tensor]) -> int | None:
        """Objects encoded straight into the segment (copied and hashed in one
        pass); the daemon checks them and copies each once into its pool."""
        S = object_size(ns)
        got = None if self.seg is None else self.seg.stretch(len(hashes) * S)
        if got is None:  # no segment, or loaded blocks the caller holds fill it
            return None
        offset, area = got
        encode_rows(area.view(len(hashes), S), ns, hashes, payloads)
        req = pb.ShmRequest(ns=ns_pb(ns), hashes=list(hashes), attachment=self.attachment, offset=offset)
        return self.call(Op.STORE_SHM, req).stored

    def _pool(self, ns: Namespace) -> PoolMap | None:
        """This process's mapping of the daemon's pool, mapped on first use;
        None without the same-host socket, when the daemon does not share its pool, or
        when this namespace's objects do not fit its slots."""
        if self.pool is None and self.socket is not None and not self.pool_refused:
            try:
                reply, fd = self.socket.call_fd(Op.MAP_POOL, pb.PoolRequest(ns=ns_pb(ns)))
            except SocketCallError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    raise
                self.pool_refused = True  # not shared (several tenants, not a pool): the segment it is
                return None
            self.pool = map_pool(fd, reply)
        pool = self.pool
        return pool if pool is not None and object_size(ns) <= pool.slot_bytes else None


def _check_sizes(sizes: Sequence[int], n: int, payload_bytes: int) -> None:
    if len(sizes) != n or any(s not in (0, payload_bytes) for s in sizes):
        raise ProtocolError(f"daemon announced sizes {list(sizes)[:8]}... for {n} blocks of {payload_bytes} bytes")


def _payload_views(area: torch.Tensor, ns: Namespace, n: int) -> list[torch.Tensor]:
    """Payload views of the n objects laid out back to back in `area`: one
    strided view, unbound (a view per block built in Python costs more than
    copying a small block)."""
    S, item = object_size(ns), torch_dtype(ns).itemsize
    rows = area[: n * S].view(torch_dtype(ns)).view(n, S // item)
    return list(rows[:, HEADER_SIZE // item:].view(n, *ns.block_shape).unbind(0))
