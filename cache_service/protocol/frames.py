"""The frame format of tierkv's framed sockets (the same-host socket, the TCP
data path): little-endian u32 body length, u8 op (request) or status code
(reply), then the body. Both ends import this module and nothing else of
each other."""
from __future__ import annotations

import socket
import struct

import grpc

FRAME = struct.Struct("<IB")
HELLO, LOAD_SHM, STORE_SHM, LOAD, STORE, MAP_POOL, RESERVE, COMMIT = 0, 1, 2, 3, 4, 5, 6, 7
NAMES = {"LoadShm": LOAD_SHM, "StoreShm": STORE_SHM, "MapPool": MAP_POOL, "Reserve": RESERVE, "Commit": COMMIT}
MAX_BODY = 16 << 20  # a ShmRequest of the daemon's max_blocks hashes is ~1.2 MB
HELLO_BODY = 4096  # what a peer may send before it has shown a token
HELLO_TIMEOUT_S = 10.0  # for the HELLO, and for the bytes of a call once its frame came
CALL_TIMEOUT_S = 120.0
CODES = {c.value[0]: c for c in grpc.StatusCode}


def send(sock: socket.socket, tag: int, body: bytes, fds: list[int] | None = None) -> None:
    """One frame; `fds` (Unix sockets) travel with its first bytes."""
    data = FRAME.pack(len(body), tag) + body
    if fds:
        data = data[socket.send_fds(sock, [data], fds):]
    sock.sendall(data)


def receive(sock: socket.socket, max_body: int = MAX_BODY) -> tuple[int, bytes] | None:
    """(tag, body) of the next frame; None when the peer closed between frames."""
    head = exactly(sock, FRAME.size, eof_ok=True)
    if head is None:
        return None
    n, tag = FRAME.unpack(head)
    if n > max_body:
        raise ConnectionError(f"doorbell frame of {n} bytes exceeds {max_body}")
    return tag, exactly(sock, n)


def exactly(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    if not fill(sock, memoryview(buf), eof_ok):
        return None
    return bytes(buf)


def fill(sock: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    """Read exactly len(view) bytes into view; False if the peer closed before
    the first byte and `eof_ok`, ConnectionError if it closed any later."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            if eof_ok and not got:
                return False
            raise ConnectionError("connection closed mid-frame")
        got += k
    return True
