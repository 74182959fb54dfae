"""Lookups across processes. vLLM may run its worker in another process than
the scheduler (the CPU backend does by default). An embedded store
(local://) can be opened by one process only, so the worker owns it and
answers the scheduler's lookups (`LookupServer`) over an abstract Unix
socket named after the store directory and the vLLM instance (`RemoteLookup`
asks): a scheduler reaches its own worker only, never another instance's on
the same directory. An abstract name has no file permissions, so both ends
check that the other runs as the same user (`FramedServer(same_user=True)`,
`SocketClient`).
Wire: tierkv's framed sockets (cache_service/protocol/frames.py), HELLO with
no token, then LOOKUP calls (bodies: cache_service/protocol/ops.py: LookupBody)."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

import grpc
import xxhash

from cache_service.protocol.ops import LookupBody, Op
from cache_service.protocol.socket_client import SocketClient
from cache_service.protocol.socket_server import Connection, FramedServer, abstract_listener
from connectors.client import CacheClient, local_config
from tiers.types import BlockHash

log = logging.getLogger("vllm.tierkv")  # under vLLM's logger, so its handler shows our lines


def lookup_address(url: str, instance: str) -> str:
    """The abstract socket of the worker of vLLM instance `instance` that owns the embedded store of `url`."""
    path = Path(local_config(url).tiers.disk.path).resolve()
    return "\0tierkv-lookup-" + xxhash.xxh3_64_hexdigest(f"{path}\0{instance}".encode())


def is_local(url: str) -> bool:
    return urlsplit(url).scheme == "local"


class RemoteLookup:
    """The scheduler's view of an embedded store owned by a worker process:
    `lookup` only (all the scheduler needs). A failure is a miss, and for
    `QUIET_S` after it lookups miss without asking: the scheduler's step
    runs them inline and must not wait out a timeout per request."""

    QUIET_S = 5.0

    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._client: SocketClient | None = None
        self._lock = threading.Lock()
        self._quiet_until = 0.0
        self.errors = 0

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        body = LookupBody.request(hashes)
        with self._lock:
            if time.monotonic() < self._quiet_until:
                return 0
            for attempt in range(2):  # one reconnect: the worker may have restarted its server
                began = time.monotonic()
                try:
                    if self._client is None:
                        self._client = SocketClient(self.address, None, self.timeout_s)
                    return LookupBody.held(self._client.ask(Op.LOOKUP, body))
                except (OSError, grpc.RpcError) as e:
                    self._drop()
                    slow = time.monotonic() - began >= self.timeout_s / 2  # timed out: a slow worker is not asked twice
                    if attempt or slow:
                        self.errors += 1
                        self._quiet_until = time.monotonic() + self.QUIET_S
                        log.warning("tierkv: lookup via the worker's store failed (%s); misses for %.0f s",
                                    e, self.QUIET_S)
                        break
        return 0

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class LookupServer:
    """Answers a scheduler's lookups against the store this worker owns
    (see `RemoteLookup`): a framed-socket server on `address`."""

    def __init__(self, client: CacheClient, address: str) -> None:
        self.client, self.address = client, address
        self._server = FramedServer(abstract_listener(address), lambda body: None, self._dispatch,
                                    name="tierkv-lookup", same_user=True).start()

    def _dispatch(self, conn: Connection, op: int, body: bytes, peer) -> tuple[grpc.StatusCode, bytes, list]:
        if op != Op.LOOKUP:
            conn.unread = True  # an unknown op: the connection ends after the answer
            return grpc.StatusCode.UNIMPLEMENTED, f"tierkv-lookup: no op {op} here".encode(), []
        try:
            held = self.client.lookup(LookupBody.hashes(body))
        except Exception:  # dispatch boundary: a failing store answers "nothing held"
            log.exception("tierkv: lookup for the scheduler failed")
            held = 0
        return grpc.StatusCode.OK, LookupBody.reply(held), []

    def close(self) -> None:
        self._server.close(grace_s=1.0)
