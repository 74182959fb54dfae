"""The daemon's gRPC servicer: the TierKV API (proto/tierkv.proto) over one
`TieredStore`, bounded by the config's [server] section (`servicer.s`, a
`cache_service.config.ServerConfig`): what a request may ask for.

Every method runs through `cache_service.server.rpc.rpc` (auth, status codes,
metrics). Keys the store sees are `tenant_keys(tenant, hashes)` and object
headers carry ``ns.with_tenant(tenant)``, so tenants are disjoint. Nothing
is stored until a request has been checked in full: a Store stream that
ends early, overruns its declared size or is cancelled stores nothing.
`cache_service/server/daemon.py` builds the grpc server around this servicer.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Iterator

import grpc
import torch

from cache_service.blocks.keys import tenant_keys
from cache_service.config import ServerConfig
from cache_service.server.auth import Authenticator
from cache_service.protocol.streaming import (WIRE_VERSION, FramingError, ObjectReader, StoreMessage, admit, load_messages,
                                   object_pieces)
from cache_service.blocks.keys import Namespace
from cache_service.server.metrics import Metrics
from cache_service.protocol.batches import per_bytes, split
from cache_service.blocks.objects import HEADER_SIZE, adopt, object_size
from cache_service.server.rpc import rpc
from cache_service.server.stalls import StallGuard
from cache_service.sessions.manifests import SessionManager, check_id, check_ids
from cache_service.sessions.quota import SessionQuota
from cache_service.protocol.segment import DATA_OFFSET, host_id
from cache_service.server.attachments import Attachments
from cache_service.store.tiered_store import TieredStore
from cache_service.protocol.messages import (RequestError, hashes_from_pb, invalid, ns_from_pb, require_ns, session_from_pb,
                                session_to_pb, stats_to_pb)
from proto import tierkv_pb2 as pb
from proto import tierkv_pb2_grpc as pb_grpc
from tiers.host_copy import copy_hashed
from tiers.types import BlockHash, CorruptBlockError

MIN_STORE_RATE = 1 << 20  # bytes/s: a Store stream slower than this is cut off (it holds one of few workers)


class TierKVServicer(pb_grpc.TierKVServicer):
    """Implements tierkv.v1.TierKV; thread-safe (the store and the maps are)."""

    def __init__(self, store: TieredStore, settings: ServerConfig, auth: Authenticator, metrics: Metrics,
                 attachments: Attachments, sessions: SessionManager) -> None:
        self.store, self.s, self.auth, self.metrics = store, settings, auth, metrics
        self.attachments, self.sessions = attachments, sessions
        self.quota = SessionQuota(sessions.list, settings.max_sessions)  # manifests per tenant
        self.host_id = host_id()
        self.started = time.monotonic()
        self.in_flight = 0  # RPCs being handled (rpc.py counts them); a drain waits for these
        self.in_flight_lock = threading.Lock()
        self.socket_path = ""  # the same-host socket for the shared-memory calls, once the daemon opened one
        self.data_port = 0  # the streamed data path's TCP port, once the daemon opened one
        self.stalls = StallGuard(settings.stream_idle_s)  # streams that stall are cancelled: workers are few

    # ------------------------------------------------------------ helpers
    def _blocks(self, msg, tenant: str | None, need_ns: bool = True) -> tuple[Namespace | None, list[BlockHash]]:
        """(tenant-salted namespace, store keys) of a request with ns + hashes."""
        ns = require_ns(msg) if need_ns else (ns_from_pb(msg.ns) if msg.HasField("ns") else None)
        hashes = hashes_from_pb(msg.hashes, self.s.max_blocks)
        if ns is not None:
            ns = ns.with_tenant(self.auth.resolve(tenant, ns.tenant_salt))
            if ns.payload_bytes > self.s.max_request_bytes:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"one block of this namespace is {ns.payload_bytes} bytes; "
                                   f"the daemon's limit is {self.s.max_request_bytes} per request")
        return ns, tenant_keys(tenant, hashes)

    def _check_request_bytes(self, n: int, ns: Namespace) -> int:
        total = n * ns.payload_bytes
        if total > self.s.max_request_bytes:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{n} blocks of {ns.payload_bytes} bytes exceed the daemon's "
                               f"{self.s.max_request_bytes}-byte limit per request; split the batch")
        return total

    def _session_ns(self, msg, tenant: str | None) -> Namespace:
        """The namespace a session call hashes its tokens under (as the client did)."""
        ns = require_ns(msg)
        self.auth.resolve(tenant, ns.tenant_salt)
        return ns

    def _in_session(self, call, *args, **kwargs):
        """`call` (a SessionManager method), whose bad token ids are the client's error."""
        try:
            return call(*args, **kwargs)
        except ValueError as e:
            raise invalid(f"session: {e}") from None

    # ------------------------------------------------------------ blocks
    @rpc
    def Hello(self, request, context, tenant):
        s = self.s
        return pb.HelloReply(version=WIRE_VERSION, host_id=self.host_id, auth_required=self.auth.enabled,
                             tenant=tenant or "", max_message_bytes=s.max_message_bytes, chunk_bytes=s.chunk_bytes,
                             max_request_bytes=s.max_request_bytes, max_blocks=s.max_blocks,
                             data_port=self.data_port, data_batch_bytes=s.load_batch_bytes)

    @rpc
    def Lookup(self, request, context, tenant):
        _, keys = self._blocks(request, tenant, need_ns=False)
        return pb.LookupReply(blocks=self.store.lookup(keys))

    @rpc
    def Load(self, request, context, tenant):
        # whole objects, headed for the client's (namespace, hash): it checks them (cache_service/protocol/streaming.py)
        ns, keys = self._blocks(request, tenant)
        messages = load_messages(self._loaded(request, ns, keys, tenant), ns.payload_bytes, self.s.chunk_bytes)
        yield from self.stalls.replies(context, messages)

    def _loaded(self, request, ns: Namespace, keys: list[BlockHash], tenant: str | None) -> Iterator[list | None]:
        """Load's object pieces (streaming.object_pieces) per block, None for a
        miss, read a few messages ahead of the socket: the first message leaves
        without waiting for the whole request to be read."""
        sent_ns, sent = ns_from_pb(request.ns), hashes_from_pb(request.hashes, self.s.max_blocks)
        S = object_size(ns)
        for part in split(len(keys), per_bytes(min(self.s.load_batch_bytes, 4 * self.s.chunk_bytes), S)):
            buf = torch.empty(len(part) * S, dtype=torch.uint8)  # a few MiB: the allocator recycles it
            hits = self.store.load_into(ns, [keys[i] for i in part], buf.view(len(part), S))
            objs = memoryview(buf.numpy())
            pieces = [object_pieces(objs[j * S: (j + 1) * S], ns, keys[i], sent_ns, sent[i]) if hit else None
                      for j, (i, hit) in enumerate(zip(part, hits))]
            yield from pieces
            self.metrics.moved(tenant, "load", ns.payload_bytes * sum(p is not None for p in pieces))

    @rpc
    def Store(self, request_iterator, context, tenant):
        request_iterator = self.stalls.requests(context, request_iterator)
        first = next(request_iterator, None)
        if first is None:
            raise invalid("empty Store stream: the first message must carry ns and hashes")
        if first.error:
            raise invalid(f"malformed Store message: {first.error}")
        ns, keys = self._blocks(first.head, tenant)
        total = self._check_request_bytes(len(keys), ns)
        objs, reader = self._receive_objects(first, request_iterator, ns, keys)
        if len(objs) < len(keys):
            if _went_away(context):
                raise RequestError(grpc.StatusCode.CANCELLED, "the client went away mid-stream; nothing stored")
            raise invalid(f"Store sent {reader.received} bytes; {len(keys)} block objects of {reader.size} "
                          f"bytes need {len(keys) * reader.size}")
        stored = self.store.store_objects(ns, keys, objs, verify=False, owned=True)  # checked on arrival
        self.metrics.moved(tenant, "store", total)
        return pb.StoreReply(stored=stored)

    def _receive_objects(self, first: StoreMessage, rest, ns: Namespace,
                         keys: list[BlockHash]) -> tuple[list[torch.Tensor], ObjectReader]:
        """Store's objects, each checked in full as it arrives (framing.admit),
        mostly left in the received messages; stops early if the stream does."""
        sent_ns, sent = ns_from_pb(first.head.ns), hashes_from_pb(first.head.hashes, self.s.max_blocks)
        reader, objs = ObjectReader(object_size(ns)), []
        reader.expect(len(keys))
        # a worker is held while the bytes come: at a floor rate, not one message per idle period for ever
        until = time.monotonic() + self.s.stream_idle_s + len(keys) * reader.size / MIN_STORE_RATE
        for msg in itertools.chain([first], rest):
            if msg.error:
                raise invalid(f"malformed Store message: {msg.error}")
            if msg is not first and (msg.head.HasField("ns") or len(msg.head.hashes)):
                raise invalid("ns and hashes belong in the first Store message only")
            if msg is not first and not len(msg.data):  # each counted as progress: a worker held for nothing
                raise invalid("a Store message after the first must carry object bytes")
            if time.monotonic() > until:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"Store sent {reader.received} bytes, slower than {MIN_STORE_RATE >> 20} MiB/s")
            try:
                for obj in reader.feed(msg.data):
                    objs.append(admit(obj, sent_ns, sent[len(objs)], ns, keys[len(objs)]))
            except FramingError:
                raise invalid(f"Store sent more than {len(keys)} block objects of {reader.size} bytes") from None
            except CorruptBlockError as e:
                raise invalid(f"Store: block {len(objs)} is not a valid object for its hash ({e})") from None
        return objs, reader

    # ------------------------------------------------------------ shared memory
    @rpc
    def Attach(self, request, context, tenant):
        aid, nbytes = self.attachments.attach(request.name, request.nonce, tenant)
        return pb.AttachReply(attachment=aid, data_offset=DATA_OFFSET, size=nbytes, socket_path=self.socket_path)

    @rpc
    def Detach(self, request, context, tenant):
        self.attachments.detach(request.attachment, tenant)
        return pb.DetachReply()

    @rpc
    def LoadShm(self, request, context, tenant):
        ns, keys = self._blocks(request, tenant)
        S = object_size(ns)
        region = self.attachments.get(request.attachment, tenant).region(request.offset, len(keys) * S)
        # one copy: pool slot -> the client's object slot i, verified there
        hits = self.store.load_into(ns, keys, region.view(len(keys), S))
        sizes = [ns.payload_bytes if hit else 0 for hit in hits]
        self.metrics.moved(tenant, "load", sum(sizes))
        return pb.LoadShmReply(sizes=sizes)

    @rpc
    def StoreShm(self, request, context, tenant):
        ns, keys = self._blocks(request, tenant)
        S, total = object_size(ns), self._check_request_bytes(len(keys), ns)
        region = self.attachments.get(request.attachment, tenant).region(request.offset, len(keys) * S)
        sent_ns, sent = ns_from_pb(request.ns), hashes_from_pb(request.hashes, self.s.max_blocks)
        # Copied out of the client's memory, hashed as copied, and checked there: the client can
        # still write its segment, so bytes checked in place could change before the store copies them.
        rows = torch.empty(len(keys), S, dtype=torch.uint8)
        sums = copy_hashed(list(rows.numpy()), list(region.view(len(keys), S).numpy()), HEADER_SIZE)
        try:
            adopt(rows, sent_ns, sent, ns, keys, sums)
        except CorruptBlockError as e:
            raise invalid(f"StoreShm: bad block object in shared memory ({e})") from None
        stored = self.store.store_objects(ns, keys, rows.unbind(0), verify=False, owned=True)
        self.metrics.moved(tenant, "store", total)
        return pb.StoreReply(stored=stored)

    # ------------------------------------------------------------ admin
    @rpc
    def Delete(self, request, context, tenant):
        _, keys = self._blocks(request, tenant, need_ns=False)
        return pb.DeleteReply(removed=self.store.delete(keys))

    @rpc
    def Pin(self, request, context, tenant):
        _, keys = self._blocks(request, tenant, need_ns=False)
        held = [h for h, ok in zip(keys, self.store.holds(keys)) if ok]  # a pin keeps a block: of absent ones, nothing
        self.store.pins.pin(held, request.ttl_s if request.ttl_s > 0 else None, tenant or "")
        return pb.PinReply()

    @rpc
    def Unpin(self, request, context, tenant):
        _, keys = self._blocks(request, tenant, need_ns=False)
        self.store.pins.unpin(keys)
        return pb.PinReply()

    @rpc
    def PinSession(self, request, context, tenant):
        check_id(request.session_id)
        owner = self.auth.resolve(tenant, request.tenant)  # auth off: the tenant asked for (it was "" for all)
        if request.release:
            return pb.PinSessionReply(released=self.store.pins.unpin_session(owner, request.session_id))
        ns, keys = self._blocks(request, tenant)
        yielded = self.store.pins.pin_session(owner, request.session_id, keys,
                                              request.ttl_s if request.ttl_s > 0 else None, ns.payload_bytes)
        return pb.PinSessionReply(yielded=yielded)

    @rpc
    def Prefetch(self, request, context, tenant):
        ns, keys = self._blocks(request, tenant)
        return pb.PrefetchReply(queued=self.store.prefetch(ns, keys))

    @rpc
    def Stats(self, request, context, tenant):
        return stats_to_pb(self.store.stats(), self.daemon_stats())

    def daemon_stats(self) -> dict[str, int]:
        count, nbytes = self.attachments.counts()
        return {"uptime_seconds": int(time.monotonic() - self.started), "shm_attachments": count,
                "shm_attached_bytes": nbytes, "rpcs_in_flight": self.in_flight, **self.store.pins.stats()}

    # ------------------------------------------------------------ sessions
    # (cache_service/sessions/manifests.py: SessionManager; the manifests' owner is the
    # tenant asked for, the blocks' keys are salted for the authenticated one)
    @rpc
    def SaveSession(self, request, context, tenant):
        s = session_from_pb(request.session)
        s.tenant = self.auth.resolve(tenant, s.tenant)
        check_ids(s.session_id, s.tenant)  # a refused id must not take a place in the quota
        ns = self._session_ns(request, tenant) if request.pin else None
        new = self.quota.admit(s.tenant, s.session_id)
        try:
            self._in_session(self.sessions.save, s, ns, key_tenant=tenant, pin=request.pin,
                             pin_ttl_s=request.pin_ttl_s if request.pin_ttl_s > 0 else None)
        except BaseException:
            if new and s.session_id not in self.sessions.list(s.tenant):  # unless a concurrent save of it landed
                self.quota.forget(s.tenant, s.session_id)
            raise
        return pb.SessionReply(session=session_to_pb(s), found=True)

    @rpc
    def ResumeSession(self, request, context, tenant):
        owner = self.auth.resolve(tenant, request.tenant)
        ns = self._session_ns(request, tenant) if request.HasField("ns") else None
        s, cached = self._in_session(self.sessions.resume, owner, request.session_id, ns, key_tenant=tenant)
        if s is None:
            return pb.SessionReply(found=False)
        return pb.SessionReply(session=session_to_pb(s), found=True, cached_blocks=cached)

    @rpc
    def ListSessions(self, request, context, tenant):
        return pb.ListSessionsReply(session_ids=self.sessions.list(self.auth.resolve(tenant, request.tenant)))

    @rpc
    def DeleteSession(self, request, context, tenant):
        owner = self.auth.resolve(tenant, request.tenant)
        deleted = self._in_session(self.sessions.delete, owner, request.session_id)
        self.quota.forget(owner, request.session_id)
        return pb.DeleteSessionReply(deleted=deleted)


def _went_away(context, wait_s: float = 0.5) -> bool:
    """Whether a Store stream that ended short was the client cancelling. Its end of stream can reach the
    handler before the context turns inactive; a client that half-closed short still waits for an answer,
    so the call does not terminate within `wait_s`."""
    ended = threading.Event()
    if not context.add_callback(ended.set):  # already terminated
        return True
    return ended.wait(wait_s) or not context.is_active()
