"""Lookups across processes. vLLM may run its worker in another process than
the scheduler (the CPU backend does by default). An embedded store
(local://) can be opened by one process only, so the worker owns it and
answers the scheduler's lookups (`LookupServer`) over an abstract Unix
socket named after the store directory and the vLLM instance (`RemoteLookup`
asks): a scheduler reaches its own worker only, never another instance's on
the same directory. An abstract name has no file permissions, so both ends
check that the other runs as the same user (`FramedServer(same_user=True)`,
`SocketClient`).
The session hints (hints.py) of a scheduler in another process are acted on
there too: PIN_SESSION and PREFETCH calls.
Wire: tierkv's framed sockets (cache_service/protocol/frames.py), HELLO with
no token, then LOOKUP calls (bodies: cache_service/protocol/ops.py: LookupBody)
and the hints' (PinSessionRequest, PrefetchRequest)."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

import grpc
import xxhash

from cache_service.blocks.keys import Namespace
from cache_service.protocol.messages import RequestError, hashes_from_pb, invalid, ns_to_pb, parse, require_ns
from cache_service.protocol.ops import SPECS, LookupBody, Op
from cache_service.protocol.socket_client import SocketClient
from cache_service.protocol.socket_server import Connection, FramedServer, abstract_listener
from cache_service.sessions.manifests import SessionError, check_id
from connectors.client import CacheClient, local_config
from proto import tierkv_pb2 as pb
from tiers.types import BlockHash, TierUnavailableError

log = logging.getLogger("vllm.tierkv")  # under vLLM's logger, so its handler shows our lines
MAX_HINT_BLOCKS = 1 << 20  # a session's blocks in one pin: a 16M-token conversation at 16 per block


def lookup_address(url: str, instance: str) -> str:
    """The abstract socket of the worker of vLLM instance `instance` that owns the embedded store of `url`."""
    path = Path(local_config(url).tiers.disk.path).resolve()
    return "\0tierkv-lookup-" + xxhash.xxh3_64_hexdigest(f"{path}\0{instance}".encode())


def is_local(url: str) -> bool:
    return urlsplit(url).scheme == "local"


class RemoteLookup:
    """The scheduler's view of an embedded store owned by a worker process:
    its lookups, and the session hints' pins and prefetches. A failed lookup
    is a miss, and for `QUIET_S` after it lookups miss without asking: the
    scheduler's step runs them inline and must not wait out a timeout per
    request. A failed hint raises TierUnavailableError (hints.py logs it)."""

    QUIET_S = 5.0

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._client: SocketClient | None = None
        self._lock = threading.Lock()
        self._quiet_until = 0.0
        self.errors = 0

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        if time.monotonic() < self._quiet_until:
            return 0
        try:
            return LookupBody.held(self._ask(Op.LOOKUP, LookupBody.request(hashes)))
        except (OSError, grpc.RpcError) as e:
            self.errors += 1
            self._quiet_until = time.monotonic() + self.QUIET_S
            log.warning("tierkv: lookup via the worker's store failed (%s); misses for %.0f s", e, self.QUIET_S)
            return 0

    def pin_session(self, tenant: str, session: str, ns: Namespace, hashes: Sequence[BlockHash],
                    ttl_s: float | None) -> list[str]:
        """`SessionPins` in the worker's store (connectors/session_hints.py)."""
        return list(self._call(Op.PIN_SESSION, pb.PinSessionRequest(
            tenant=tenant, session_id=session, ns=ns_to_pb(ns), hashes=list(hashes), ttl_s=ttl_s or 0.0)).yielded)

    def unpin_session(self, tenant: str, session: str) -> bool:
        return self._call(Op.PIN_SESSION, pb.PinSessionRequest(tenant=tenant, session_id=session, release=True)).released

    def prefetch(self, ns: Namespace, hashes: Sequence[BlockHash]) -> int:
        """Have the worker's store bring blocks held below up to its top tier; how many it queued."""
        return self._call(Op.PREFETCH, pb.PrefetchRequest(ns=ns_to_pb(ns), hashes=list(hashes))).queued

    def _call(self, op: Op, request):
        try:
            return SPECS[op].reply.FromString(self._ask(op, request.SerializeToString()))
        except (OSError, grpc.RpcError) as e:
            raise TierUnavailableError(f"the worker's store: {SPECS[op].method} failed: {e}") from None

    def _ask(self, op: Op, body: bytes) -> bytes:
        """One call on the connection, with one reconnect when it broke at once (the worker may have
        restarted its server), none after a timeout (a slow worker is not asked twice)."""
        with self._lock:
            for attempt in range(2):
                began = time.monotonic()
                try:
                    if self._client is None:
                        self._client = SocketClient(self.address, None, self.timeout_s)
                    return self._client.ask(op, body)
                except (OSError, grpc.RpcError):
                    self._drop()
                    if attempt or time.monotonic() - began >= self.timeout_s / 2:
                        raise
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class LookupServer:
    """Answers a scheduler's calls (see `RemoteLookup`) against the store
    this worker owns: a framed-socket server on `address`."""

    def __init__(self, client: CacheClient, address: str) -> None:
        self.client, self.address = client, address
        self._server = FramedServer(abstract_listener(address), lambda body: None, self._dispatch,
                                    name="tierkv-lookup", same_user=True).start()

    def _dispatch(self, conn: Connection, op: int, body: bytes, peer) -> tuple[grpc.StatusCode, bytes, list]:
        handler = {Op.LOOKUP: self._lookup, Op.PIN_SESSION: self._pin_session, Op.PREFETCH: self._prefetch}.get(op)
        if handler is None:
            conn.unread = True  # an unknown op: the connection ends after the answer
            return grpc.StatusCode.UNIMPLEMENTED, f"tierkv-lookup: no op {op} here".encode(), []
        try:
            return grpc.StatusCode.OK, handler(body), []
        except RequestError as e:
            return e.code, str(e).encode(), []
        except Exception as e:  # dispatch boundary: the scheduler's hint fails, the worker goes on
            log.exception("tierkv: %s for the scheduler failed", Op(op).name.lower())
            return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}".encode(), []

    def _lookup(self, body: bytes) -> bytes:
        try:
            held = self.client.lookup(LookupBody.hashes(body))
        except Exception:  # dispatch boundary: a failing store answers "nothing held"
            log.exception("tierkv: lookup for the scheduler failed")
            held = 0
        return LookupBody.reply(held)

    def _pin_session(self, body: bytes) -> bytes:
        req = parse(pb.PinSessionRequest, body, "PinSession")
        try:
            check_id(req.session_id)
        except SessionError as e:
            raise invalid(str(e)) from None
        pins = self.client.pins
        if req.release:
            return pb.PinSessionReply(released=pins.unpin_session(req.tenant, req.session_id)).SerializeToString()
        ns, hashes = require_ns(req), hashes_from_pb(req.hashes, MAX_HINT_BLOCKS)
        yielded = pins.pin_session(req.tenant, req.session_id, hashes, req.ttl_s if req.ttl_s > 0 else None,
                                   ns.payload_bytes)
        return pb.PinSessionReply(yielded=yielded).SerializeToString()

    def _prefetch(self, body: bytes) -> bytes:
        req = parse(pb.PrefetchRequest, body, "Prefetch")
        ns, hashes = require_ns(req), hashes_from_pb(req.hashes, MAX_HINT_BLOCKS)
        return pb.PrefetchReply(queued=self.client.prefetch(ns, hashes)).SerializeToString()

    def close(self) -> None:
        self._server.close(grace_s=1.0)
