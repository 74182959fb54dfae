"""`GrpcClient`: the `CacheClient` of the standalone daemon (``grpc://host:port``).

Same semantics as an embedded `TieredStore`: ``lookup`` returns the held
prefix length, ``load`` verified payloads or None per block, ``store`` the
number of blocks new to the top tier. Argument errors (mismatched lengths,
wrong payload sizes) raise ValueError before anything is sent, exactly as
the store does.

Failure policy: a daemon that cannot be reached (or refuses the token) at
construction raises `TierUnavailableError`, so the CLI can run without a
cache. Once running, a failed lookup/load is a miss and a failed store is a
dropped store; both are logged (rate-limited) and counted in ``errors``,
never raised into the engine. Admin calls (stats, pin, sessions, ...) raise
`TierUnavailableError` instead, since their caller wants to know.

URL: ``grpc://host:port?transport=auto|shm|stream&tls=1&ca=/ca.pem&timeout=30&lookup_timeout=5``
(add ``cert=/client.pem&key=/client.key`` for a daemon that wants client certificates).
``transport=auto`` (default) uses shared memory when the daemon runs on this
host and can map a segment this process creates (cache_service/protocol/segment.py),
sending its calls over the daemon's same-host socket (server/socket_server.py)
and storing straight into the daemon's host pool when it shares it
(server/pool.py; connectors/grpc/same_host.py); else it streams bytes, over the daemon's TCP data path (server/data_path.py)
when it has one, else through gRPC. The token comes from the ``token``
argument or ``TIERKV_TOKEN``.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Sequence
from urllib.parse import parse_qs, urlsplit

import grpc
import torch

from cache_service.protocol import streaming as framing
from cache_service.protocol.tls import channel_credentials
from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import object_size
from cache_service.protocol.segment import host_id
from cache_service.protocol.messages import check_payloads, stats_from_pb
from cache_service.protocol.batches import split
from cache_service.protocol.socket_client import SocketCallError
from connectors.grpc.breaker import Breaker
from connectors.grpc.data_path import DataPathLink
from connectors.grpc.pool_map import ProtocolError, ns_pb as _ns
from connectors.grpc.same_host import SameHost
from connectors.grpc.sessions import RemoteSessions
from proto import tierkv_pb2 as pb
from proto import tierkv_pb2_grpc as pb_grpc
from tiers.types import BlockHash, TierKVError, TierUnavailableError

log = logging.getLogger("tierkv.client")
TRANSPORTS = ("auto", "shm", "stream")
LOOKUP_TIMEOUT_S = 5.0
_RECEIVE_LIMIT = 256 << 20  # accept any message size a daemon may be configured for
# answers given before the daemon touches a segment: the segment stays usable
_REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.PERMISSION_DENIED})


class GrpcClient:
    """Client of one daemon; thread-safe."""

    def __init__(self, url: str, token: str | None = None, *, transport: str | None = None,
                 tls_ca: str | None = None, timeout_s: float | None = None, connect_timeout_s: float = 5.0,
                 shm_bytes: int = 64 << 20) -> None:
        parts = urlsplit(url)
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            port = parts.port
        except ValueError:  # not a number, or past 65535
            port = None
        if parts.scheme != "grpc" or not parts.hostname or not port:
            raise TierKVError(f"cache URL {url!r}: expected grpc://host:port with a port 1-65535")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # an IPv6 address keeps its brackets
        self.url, self.target = url, f"{host}:{port}"
        self.timeout_s = _seconds(url, "timeout", timeout_s or q.get("timeout", 30.0))
        # a lookup is a few bytes each way: a daemon that hangs costs the scheduler this, not the data timeout
        self.lookup_timeout_s = _seconds(url, "lookup_timeout", q.get("lookup_timeout", min(LOOKUP_TIMEOUT_S,
                                                                                            self.timeout_s)))
        self.errors = 0
        self.token = token or os.environ.get("TIERKV_TOKEN")
        self._md = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        # reconnect within seconds after a daemon restart (grpc's default backoff grows to 2 minutes)
        options = [("grpc.max_receive_message_length", _RECEIVE_LIMIT), ("grpc.max_reconnect_backoff_ms", 5000)]
        tls_ca = tls_ca or q.get("ca") or os.environ.get("TIERKV_TLS_CA")
        tls = q.get("tls", "0") not in ("0", "") or bool(tls_ca)
        if tls:
            creds = channel_credentials(tls_ca, q.get("cert"), q.get("key"))  # cert+key: mutual TLS
            self._channel = grpc.secure_channel(self.target, creds, options)
        else:
            self._channel = grpc.insecure_channel(self.target, options)
        self._stub = pb_grpc.TierKVStub(self._channel)
        # the streamed data path frames its messages by hand: objects are read in place (cache_service/protocol/streaming.py)
        self._load_rpc = self._channel.unary_stream("/tierkv.v1.TierKV/Load",
                                                    request_serializer=pb.LoadRequest.SerializeToString,
                                                    response_deserializer=framing.parse_load_chunk)
        self._store_rpc = self._channel.stream_unary("/tierkv.v1.TierKV/Store",
                                                     response_deserializer=pb.StoreReply.FromString)
        self._near: SameHost | None = None  # the same-host paths, once shared memory works (connectors/grpc/same_host.py)
        self._last_log: dict[str, float] = {}
        self.sessions = RemoteSessions(self.admin)  # connectors/grpc/sessions.py
        self._data_path: DataPathLink | None = None  # the TCP data path (connectors/grpc/data_path.py)
        self._hello_at = 0.0  # no Hello again before this (`_hello_again`)
        self.breaker = Breaker(lambda: self._hello(min(2.0, self.timeout_s)), self.target)  # a daemon that hangs
        try:
            self.hello = self._hello(connect_timeout_s)
            self.transport = self._pick(transport or q.get("transport", "auto"), shm_bytes)
        except BaseException:
            self.close()
            raise
        if self.hello.data_port and not tls:  # streamed bytes skip gRPC's stack (server/data_path.py)
            self._data_path = DataPathLink(parts.hostname, self.hello.data_port, self.token, self.timeout_s,
                                           self.hello.data_batch_bytes, relearn=self._data_path_now)

    # ------------------------------------------------------------ setup
    def _hello(self, timeout_s: float) -> pb.HelloReply:
        # fails fast on a refused connection: an engine starts without the cache, not after a wait
        try:
            hello = self._stub.Hello(pb.HelloRequest(), timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise TierUnavailableError(f"cannot reach the tierkv daemon at {self.target}: {_why(e)}") from None
            raise TierUnavailableError(f"tierkv daemon at {self.target} refused Hello: {_why(e)}") from None
        if hello.version != framing.WIRE_VERSION:  # another wire format: its loads and stores would all fail
            raise TierUnavailableError(f"tierkv daemon at {self.target} speaks {hello.version!r}; this client "
                                       f"needs {framing.WIRE_VERSION!r} (upgrade the older side)")
        return hello

    def _hello_again(self) -> pb.HelloReply | None:
        """Hello once more (a restarted daemon: another data port, other
        limits), at most every 10 s (between, the last answer); None if it
        does not answer."""
        now = time.monotonic()
        if now < self._hello_at:
            return self.hello
        self._hello_at = now + 10.0
        try:
            self.hello = self._hello(min(2.0, self.timeout_s))
        except TierUnavailableError:
            return None
        return self.hello

    def _data_path_now(self) -> tuple[int, int] | None:
        hello = self._hello_again()
        return None if hello is None else (hello.data_port, hello.data_batch_bytes)

    def _pick(self, transport: str, shm_bytes: int) -> str:
        if transport not in TRANSPORTS:
            raise TierKVError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        if transport == "stream":
            return "stream"
        if self.hello.host_id != host_id():
            if transport == "shm":
                raise TierUnavailableError(f"daemon at {self.target} runs on another host: no shared memory")
            return "stream"
        near = SameHost(self.call, self._store_stream, self._set_transport, self.token, self.timeout_s, shm_bytes,
                        pool_loads=not self.hello.tenant)  # a tenant's blocks are headed with its keys, not ours
        try:
            near.attach()
            self._near = near
            return "shm"
        except (OSError, grpc.RpcError) as e:
            if transport == "shm":
                raise TierUnavailableError(f"shared memory with {self.target} failed: {_why(e)}") from None
            log.info("shared memory with %s unavailable (%s); streaming bytes", self.target, _why(e))
            return "stream"

    def _set_transport(self, transport: str) -> None:
        """What the same-host paths report: "shm" once attached, "stream" once dropped."""
        self.transport = transport

    def call(self, name: str, request, timeout_s: float | None = None):
        """One unary RPC with this client's token and timeout (raises grpc.RpcError)."""
        return getattr(self._stub, name)(request, timeout=timeout_s or self.timeout_s, metadata=self._md)

    def admin(self, name: str, request, invalid: type[TierKVError] = TierKVError):
        """A unary RPC whose failure the caller should see: `invalid` for a
        refused argument, TierUnavailableError for anything else (at once
        while the breaker is open)."""
        if self.breaker.open:
            raise TierUnavailableError(f"tierkv daemon at {self.target} is not answering ({name} not sent)")
        try:
            return self.call(name, request)
        except grpc.RpcError as e:
            if _gone(e):
                self.breaker.trip()
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(f"tierkv daemon at {self.target}: {name}: {e.details()}") from None
            raise TierUnavailableError(f"tierkv daemon at {self.target}: {name} failed: {_why(e)}") from None

    def _failed(self, what: str, e: Exception, shm: bool = False) -> None:
        if _gone(e):  # no answer in time: the next calls skip the cache until it answers
            self.breaker.trip()
        if shm and self._near is not None and not (isinstance(e, grpc.RpcError) and e.code() in _REFUSED):
            self._near.drop()
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._hello_again()  # a restarted daemon may have lower limits: the next call fits them
        self.errors += 1
        now = time.monotonic()
        if now - self._last_log.get(what, -1e9) >= 10.0:  # at most one line per op per 10 s
            self._last_log[what] = now
            log.warning("tierkv daemon %s: %s failed (%s); continuing without it", self.target, what, _why(e))

    def _batches(self, n: int, block_bytes: int, room: int) -> list[range]:
        per = max(1, min(self.hello.max_blocks, room // max(block_bytes, 1)))
        return split(n, per)

    # ------------------------------------------------------------ CacheClient
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix the daemon holds (0 on failure)."""
        held = 0
        if self.breaker.open:
            return 0
        try:
            for r in self._batches(len(hashes), 1, self.hello.max_blocks):
                got = self.call("Lookup", pb.LookupRequest(hashes=list(hashes[r.start:r.stop])),
                                self.lookup_timeout_s).blocks
                held += got
                if got < len(r):
                    break
        except grpc.RpcError as e:
            self._failed("lookup", e)
            return 0
        return held

    def load(self, ns: Namespace, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Verified payloads per hash, None for a miss (and for every block of a failed call)."""
        out: list[torch.Tensor | None] = [None] * len(hashes)
        if self.breaker.open:
            return out
        shm = self._near.room(ns) if self._near is not None else 0
        batches = self._batches(len(hashes), object_size(ns), shm or 1 << 62)  # the daemon batches streamed reads
        for r in batches:
            h = hashes[r.start:r.stop]
            try:  # one batch: hand out views of the segment; more would each need their own room
                got = self._near.load(ns, h, lend=len(batches) == 1) if shm else None
                got = self._load_stream(ns, h) if got is None else got
            except (grpc.RpcError, ProtocolError) as e:
                self._failed("load", e, bool(shm))
                break
            out[r.start:r.stop] = got
        return out

    def store(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> int:
        """Send blocks to the daemon; returns how many were new to its top tier (0 for a failed call)."""
        check_payloads(ns, hashes, payloads)
        if self.breaker.open:
            return 0
        shm = self._near.room(ns) if self._near is not None else 0
        stored = 0
        per = max(1, self.hello.max_request_bytes // ns.payload_bytes)  # the daemon's limit is on payload bytes
        for r in self._batches(len(hashes), object_size(ns), min(per * object_size(ns), shm or 1 << 62)):
            h, p = hashes[r.start:r.stop], payloads[r.start:r.stop]
            try:
                got = self._near.store(ns, h, p) if shm else None
                stored += self._store_stream(ns, h, p) if got is None else got
            except (grpc.RpcError, ProtocolError) as e:
                self._failed("store", e, bool(shm))
                break
        return stored

    def stats(self) -> dict[str, dict[str, int]]:
        """The daemon store's per-tier counters (TieredStore.stats() shape)."""
        return stats_from_pb(self.admin("Stats", pb.StatsRequest()))

    def daemon_stats(self) -> dict[str, int]:
        return dict(self.admin("Stats", pb.StatsRequest()).daemon)

    def delete(self, hashes: Sequence[BlockHash], ns: Namespace | None = None) -> int:
        req = pb.BlocksRequest(hashes=list(hashes), ns=_ns(ns) if ns else None)
        return self.admin("Delete", req).removed

    def pin(self, hashes: Sequence[BlockHash], ttl_s: float | None = None, ns: Namespace | None = None) -> None:
        self.admin("Pin", pb.PinRequest(hashes=list(hashes), ttl_s=ttl_s or 0.0, ns=_ns(ns) if ns else None))

    def unpin(self, hashes: Sequence[BlockHash], ns: Namespace | None = None) -> None:
        self.admin("Unpin", pb.BlocksRequest(hashes=list(hashes), ns=_ns(ns) if ns else None))

    def pin_session(self, tenant: str, session: str, ns: Namespace, hashes: Sequence[BlockHash],
                    ttl_s: float | None) -> list[str]:
        """Pin a session's blocks in the daemon for `tenant` (with auth on, the token's, which `tenant` must
        be or leave empty); returns the sessions whose pins yielded to the tenant's cap."""
        reply = self.admin("PinSession", pb.PinSessionRequest(ns=_ns(ns), session_id=session, hashes=list(hashes),
                                                              ttl_s=ttl_s or 0.0, tenant=tenant))
        return list(reply.yielded)

    def unpin_session(self, tenant: str, session: str) -> bool:
        return self.admin("PinSession", pb.PinSessionRequest(session_id=session, release=True, tenant=tenant)).released

    def prefetch(self, ns: Namespace, hashes: Sequence[BlockHash]) -> int:
        """Have the daemon promote blocks held below its top tier; how many it queued."""
        return self.admin("Prefetch", pb.PrefetchRequest(ns=_ns(ns), hashes=list(hashes))).queued

    def close(self) -> None:
        self.breaker.close()
        if self._data_path is not None:
            self._data_path.close()
        if self._near is not None:
            self._near.close()
        self._channel.close()

    def __enter__(self) -> "GrpcClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ data paths
    def _load_stream(self, ns: Namespace, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Whole objects, checked (header and checksum; a corrupt block is a
        miss): over the daemon's TCP data path when it has one, else each copied
        once out of its gRPC message."""
        got = self._data_path.load(ns, list(hashes)) if self._data_path is not None else None
        if got is not None:
            return got
        reader = framing.LoadReader(ns, hashes)
        try:
            for sizes, data in self._load_rpc(pb.LoadRequest(ns=_ns(ns), hashes=list(hashes)),
                                              timeout=self.timeout_s, metadata=self._md):
                reader.feed(sizes, data)
            out = reader.result()
        except framing.FramingError as e:
            raise ProtocolError(f"Load: {e}") from None
        if reader.corrupt:
            log.warning("tierkv daemon %s: %d streamed blocks failed their checks; treated as misses",
                        self.target, reader.corrupt)
        return out

    def _store_stream(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> int:
        """Whole objects, checksummed here: over the TCP data path straight from the
        payloads, else copied once into gRPC messages; the daemon checks each."""
        stored = self._data_path.store(ns, list(hashes), list(payloads)) if self._data_path is not None else None
        if stored is not None:
            return stored
        head = pb.StoreChunk(ns=_ns(ns), hashes=list(hashes)).SerializeToString()
        objects = (framing.encode_pieces(ns, h, p) for h, p in zip(hashes, payloads))
        requests = framing.store_messages(head, objects, object_size(ns), self.hello.chunk_bytes)
        return self._store_rpc(requests, timeout=self.timeout_s, metadata=self._md).stored


def _seconds(url: str, name: str, value: object) -> float:
    """A URL's timeout: 0, negative, nan or inf would make every call fail (or raise) later."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < 1e6:
        raise TierKVError(f"cache URL {url!r}: {name} must be a number of seconds, above 0 and below 1e6")
    return seconds


def _gone(e: Exception) -> bool:
    """A call the daemon did not answer in time (a daemon that hangs). Not a
    refused connection or a broken socket: those fail at once, and the next
    call may well go through (gRPC, a restarted daemon)."""
    if isinstance(e, SocketCallError):
        return e.timed_out
    if isinstance(e, grpc.RpcError):
        return e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return isinstance(e, TimeoutError)


def _why(e: Exception) -> str:
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
