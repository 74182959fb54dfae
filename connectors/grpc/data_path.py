"""The client end of the daemon's TCP data path (server end and wire format:
server/data_path.py): `DataPathClient`, one connection carrying
LOAD and STORE as raw bytes, and `DataPathLink`, which connects on first use
and drops a connection whose call failed."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import HEADER_SIZE, object_size, verify
from cache_service.protocol.batches import per_bytes, split
from cache_service.protocol.ops import Op
from cache_service.protocol.messages import ns_to_pb, torch_dtype
from cache_service.protocol.socket_client import SocketCallError, SocketClient
from cache_service.protocol.streaming import encode_pieces
from proto import tierkv_pb2 as pb
from tiers.arena import Arena
from tiers.types import BlockHash

log = logging.getLogger("tierkv.client")


class DataPathClient:
    """The client end: one TCP connection, one call at a time (callers lock)."""

    def __init__(self, host: str, port: int, token: str | None, timeout_s: float, batch_bytes: int) -> None:
        # a port the client cannot reach (a firewall, a proxy in front of gRPC only) costs seconds, not timeout_s
        self._socket = SocketClient((host, port), token, timeout_s, connect_timeout_s=min(timeout_s, 3.0))
        self.batch_bytes = batch_bytes
        self._arena = Arena()
        self.corrupt = 0  # loaded blocks that failed their checks (treated as misses)

    def _parts(self, n: int, ns: Namespace) -> list[range]:
        return split(n, per_bytes(self.batch_bytes, object_size(ns)))

    def load(self, ns: Namespace, hashes: list[BlockHash]) -> list[torch.Tensor | None]:
        """Verified payloads, None per miss: views of one buffer for the whole
        load (reused by a later load once the caller dropped them)."""
        rows = self._arena.matrix(len(hashes), object_size(ns))
        out: list[torch.Tensor | None] = []
        for r in self._parts(len(hashes), ns):
            out += self._load(ns, hashes[r.start:r.stop], rows[r.start:r.stop])
        return out

    def _load(self, ns: Namespace, hashes: list[BlockHash], rows: torch.Tensor) -> list[torch.Tensor | None]:
        """One call; its hits land at the front of `rows`, in request order."""
        S = object_size(ns)
        body = self._socket.ask(Op.LOAD, pb.LoadRequest(ns=ns_to_pb(ns), hashes=hashes).SerializeToString())
        sizes: list[int] = []
        found: list[int] = []
        good: list[bool] = []
        while True:  # a group: its sizes, then its hits' objects, checked while the daemon sends the next
            group = list(pb.LoadShmReply.FromString(body).sizes)
            if not group and hashes or len(sizes) + len(group) > len(hashes) or any(
                    s not in (0, ns.payload_bytes) for s in group):  # whatever follows cannot be framed
                raise SocketCallError(grpc.StatusCode.UNAVAILABLE, f"daemon announced sizes {group[:8]}... after "
                                f"{len(sizes)} of {len(hashes)} blocks of {ns.payload_bytes} bytes")
            hits = [len(sizes) + i for i, s in enumerate(group) if s]
            part = rows[len(found): len(found) + len(hits)]
            if hits:
                self._socket.recv_into(memoryview(part.numpy()).cast("B"))
                good += self._check(part, ns, [hashes[i] for i in hits])
            sizes, found = sizes + group, found + hits
            if len(sizes) == len(hashes):
                break
            body = self._socket.reply()
        item = torch_dtype(ns).itemsize
        payloads = rows[:len(found)].view(torch_dtype(ns)).view(len(found), S // item)[:, HEADER_SIZE // item:]
        out: list[torch.Tensor | None] = [None] * len(hashes)
        for i, p, ok in zip(found, payloads.reshape(len(found), *ns.block_shape).unbind(0), good):
            out[i] = p if ok else None
        return out

    def _check(self, rows: torch.Tensor, ns: Namespace, hashes: list[BlockHash]) -> list[bool]:
        """Per object: header and checksum as (ns, hash) needs; a failure is a miss."""
        if not hashes:
            return []
        good = [c is not None for c in verify(rows, ns, hashes)]
        if not all(good):
            self.corrupt += good.count(False)
            log.warning("tierkv data path: %d loaded blocks failed their checks; treated as misses", good.count(False))
        return good

    def store(self, ns: Namespace, hashes: list[BlockHash], payloads: list[torch.Tensor]) -> int:
        """Objects sent from the caller's payloads (checksummed here, not
        copied); returns how many were new to the daemon's top tier."""
        stored = 0
        for r in self._parts(len(hashes), ns):
            hs = hashes[r.start:r.stop]
            # each block hashed just before it is sent, while the daemon reads the one before
            pieces = (piece for h, p in zip(hs, payloads[r.start:r.stop]) for piece in encode_pieces(ns, h, p))
            head = pb.StoreChunk(ns=ns_to_pb(ns), hashes=hs).SerializeToString()
            stored += pb.StoreReply.FromString(self._socket.ask(Op.STORE, head, pieces)).stored
        return stored

    def close(self) -> None:
        self._socket.close()


class DataPathLink:
    """A client's data path to one daemon: connected on first use, one call at a
    time, dropped when a call fails and tried again on a later call (at once
    after a refused call, after `retry_s` when the connection broke)."""

    def __init__(self, host: str, port: int, token: str | None, timeout_s: float, batch_bytes: int,
                 retry_s: float = 10.0, relearn: Callable[[], tuple[int, int] | None] | None = None) -> None:
        """`relearn`: asks the daemon again for its data path's (port, batch
        bytes) (a restarted daemon listens on another port); None if it cannot."""
        self._args = (host, port, token, timeout_s, batch_bytes)
        self.retry_s, self._relearn = retry_s, relearn
        self._client: DataPathClient | None = None
        self._retry_at, self._failures = 0.0, 0
        self._lock = threading.Lock()

    def load(self, ns: Namespace, hashes: list[BlockHash]) -> list[torch.Tensor | None] | None:
        """As `DataPathClient.load`; None when the data path cannot carry it now (use gRPC)."""
        return self._run(ns, lambda client: client.load(ns, hashes))

    def store(self, ns: Namespace, hashes: list[BlockHash], payloads: list[torch.Tensor]) -> int | None:
        """As `DataPathClient.store`; None when the data path cannot carry it now (use gRPC)."""
        return self._run(ns, lambda client: client.store(ns, hashes, payloads))

    def _run(self, ns: Namespace, call):
        if object_size(ns) > self._args[4]:  # one block past the data path's batch: only gRPC takes it
            return None
        with self._lock:
            if self._client is None and time.monotonic() >= self._retry_at:
                self._connect()
            if self._client is None:
                return None
            try:
                return call(self._client)
            except Exception as e:  # any failure leaves the connection out of step: drop it
                self._client.close()
                self._client = None
                if not isinstance(e, grpc.RpcError):
                    e = SocketCallError(grpc.StatusCode.UNAVAILABLE, f"data path: {type(e).__name__}: {e}")
                broke = e.code() == grpc.StatusCode.UNAVAILABLE
                self._retry_at = time.monotonic() + (self.retry_s if broke else 0.0)
                raise e from None

    def _connect(self) -> None:
        for first in (True, False):
            try:
                self._client = DataPathClient(*self._args)
                self._failures = 0
                return
            except (OSError, grpc.RpcError) as e:
                error = e
            if not first or not self._moved():
                break
        # tried again later, less often each time (up to 5 minutes)
        self._failures += 1
        self._retry_at = time.monotonic() + min(300.0, self.retry_s * 2 ** (self._failures - 1))
        log.info("tierkv data path %s:%s unusable (%s); streaming through gRPC", *self._args[:2], error)

    def _moved(self) -> bool:
        """Whether the daemon now announces its data path elsewhere (taken up here)."""
        where = self._relearn() if self._relearn is not None else None
        if where is None or not where[0] or where == (self._args[1], self._args[4]):
            return False
        host, _, token, timeout_s, _ = self._args
        self._args = (host, where[0], token, timeout_s, where[1])
        return True

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._retry_at = float("inf")
