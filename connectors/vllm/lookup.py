"""Lookups across processes. vLLM may run its worker in another process than
the scheduler (the CPU backend does by default). An embedded store
(local://) can be opened by one process only, so the worker owns it and
answers the scheduler's lookups (`LookupServer`) over an abstract Unix
socket named after the store directory (`RemoteLookup` asks).
Wire: request b"L" + <I n> + n 16-byte hashes; reply <I held>."""
from __future__ import annotations

import logging
import socket
import struct
import threading
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

import xxhash

from connectors.client import CacheClient, local_config
from tiers.types import HASH_BYTES, BlockHash

log = logging.getLogger("vllm.tierkv")  # under vLLM's logger, so its handler shows our lines
LOOKUP_REQUEST, LOOKUP_REPLY = struct.Struct("<cI"), struct.Struct("<I")


def lookup_address(url: str) -> str:
    """The abstract socket of the process that owns the embedded store of `url`."""
    path = Path(local_config(url).tiers.disk.path).resolve()
    return "\0tierkv-lookup-" + xxhash.xxh3_64_hexdigest(str(path).encode())


class RemoteLookup:
    """The scheduler's view of an embedded store owned by a worker process:
    `lookup` only (all the scheduler needs). A failure is a miss."""

    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.errors = 0

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        msg = LOOKUP_REQUEST.pack(b"L", len(hashes)) + b"".join(hashes)
        with self._lock:
            for attempt in range(2):  # one reconnect: the worker may have restarted its server
                try:
                    if self._sock is None:
                        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        self._sock.settimeout(self.timeout_s)
                        self._sock.connect(self.address)
                    self._sock.sendall(msg)
                    return LOOKUP_REPLY.unpack(recv_exact(self._sock, LOOKUP_REPLY.size))[0]
                except OSError as e:
                    self._drop()
                    if attempt:
                        self.errors += 1
                        log.warning("tierkv: lookup via the worker's store failed (%s); a miss", e)
        return 0

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def read_request(sock: socket.socket) -> list[BlockHash]:
    op, n = LOOKUP_REQUEST.unpack(recv_exact(sock, LOOKUP_REQUEST.size))
    if op != b"L":
        raise ConnectionError(f"unknown lookup op {op!r}")
    raw = recv_exact(sock, n * HASH_BYTES)
    return [BlockHash(raw[i:i + HASH_BYTES]) for i in range(0, len(raw), HASH_BYTES)]


def is_local(url: str) -> bool:
    return urlsplit(url).scheme == "local"


class LookupServer:
    """Answers a scheduler's lookups against the store this worker owns
    (see `RemoteLookup`). One thread per connection."""

    def __init__(self, client: CacheClient, address: str) -> None:
        self.client, self.address = client, address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(address)  # abstract: no file to clean up, gone with the process
        self._sock.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="tierkv-lookup", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="tierkv-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed:
                try:
                    hashes = read_request(conn)
                except (OSError, ConnectionError):
                    return
                try:
                    held = self.client.lookup(hashes)
                except Exception:  # dispatch boundary: a failing store answers "nothing held"
                    log.exception("tierkv: lookup for the scheduler failed")
                    held = 0
                try:
                    conn.sendall(LOOKUP_REPLY.pack(held))
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
