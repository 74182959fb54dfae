"""The frame format of tierkv's framed sockets (the daemon's same-host socket,
its TCP data path, the vLLM lookups): little-endian u32 body length, u8 op
(request, protocol/ops.py) or status code (reply, a grpc.StatusCode's
number), then the body. Both ends import this module and nothing else of
each other."""
from __future__ import annotations

import socket
import struct

import grpc

FRAME = struct.Struct("<IB")
MAX_BODY = 16 << 20  # a ShmRequest of the daemon's max_blocks hashes is ~1.2 MB
HELLO_BODY = 4096  # what a peer may send before it has shown a token
HELLO_TIMEOUT_S = 10.0  # for the HELLO, and for the bytes of a call once its frame came
CALL_TIMEOUT_S = 120.0
OK = grpc.StatusCode.OK.value[0]
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
        raise ConnectionError(f"frame of {n} bytes exceeds {max_body}")
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
