"""The frame format of tierkv's framed sockets (the daemon's same-host socket,
its TCP data path, the vLLM lookups): little-endian u32 body length, u8 op
(request, protocol/ops.py) or status code (reply, a grpc.StatusCode's
number), then the body. Both ends import this module and nothing else of
each other."""
from __future__ import annotations

import socket
import struct
import time

import grpc

FRAME = struct.Struct("<IB")
MAX_BODY = 16 << 20  # a ShmRequest of the daemon's max_blocks hashes is ~1.2 MB
HELLO_BODY = 4096  # what a peer may send before it has shown a token
HELLO_TIMEOUT_S = 10.0  # for the whole HELLO frame
CALL_TIMEOUT_S = 120.0  # for the whole of a call's bytes once its frame's header came (body, bulk objects)
_PIECE = 1 << 20  # a large body is read (and its buffer grown) this much at a time
OK = grpc.StatusCode.OK.value[0]
CODES = {c.value[0]: c for c in grpc.StatusCode}


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def send(sock: socket.socket, tag: int, body: bytes, fds: list[int] | None = None) -> None:
    """One frame; `fds` (Unix sockets) travel with its first bytes."""
    data = FRAME.pack(len(body), tag) + body
    if fds:
        data = data[socket.send_fds(sock, [data], fds):]
    sock.sendall(data)


def receive(sock: socket.socket, max_body: int = MAX_BODY, deadline: float | None = None,
            body_s: float | None = None) -> tuple[int, bytes] | None:
    """(tag, body) of the next frame; None when the peer closed between frames.
    `deadline` (time.monotonic()) bounds the whole frame, `body_s` its body
    once the header came: TimeoutError past either. A body is read piece by
    piece, so a header announcing many bytes costs nothing until they come."""
    head = exactly(sock, FRAME.size, eof_ok=True, deadline=deadline)
    if head is None:
        return None
    n, tag = FRAME.unpack(head)
    if n > max_body:
        raise ConnectionError(f"frame of {n} bytes exceeds {max_body}")
    if body_s is not None:
        deadline = min(deadline or float("inf"), time.monotonic() + body_s)
    body = bytearray()
    while len(body) < n:
        body += exactly(sock, min(_PIECE, n - len(body)), deadline=deadline)
    return tag, bytes(body)


def exactly(sock: socket.socket, n: int, eof_ok: bool = False, deadline: float | None = None) -> bytes | None:
    buf = bytearray(n)
    if not fill(sock, memoryview(buf), eof_ok, deadline):
        return None
    return bytes(buf)


def fill(sock: socket.socket, view: memoryview, eof_ok: bool = False, deadline: float | None = None) -> bool:
    """Read exactly len(view) bytes into view; False if the peer closed before
    the first byte and `eof_ok`, ConnectionError if it closed any later,
    TimeoutError if they have not all come by `deadline` (time.monotonic())."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(view) - got} bytes of a frame did not come in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            if eof_ok and not got:
                return False
            raise ConnectionError("connection closed mid-frame")
        got += k
    return True
