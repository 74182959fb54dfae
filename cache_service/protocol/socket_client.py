"""The client end of tierkv's framed sockets (server end:
protocol/socket_server.py; frames: protocol/frames.py; ops: protocol/ops.py):
`SocketClient`, one connection that sends calls and reads their replies,
and `SocketCallError`, which is a grpc.RpcError so callers handle the socket
and gRPC paths alike."""
from __future__ import annotations

import logging
import os
import socket

import grpc

from cache_service.protocol.frames import CODES, FRAME, MAX_BODY, OK, exactly, fill, peer_uid, send
from cache_service.protocol.ops import SPECS, Op


class SocketCallError(grpc.RpcError):
    """A socket call that failed: the status the server answered, or
    UNAVAILABLE when the connection broke (or timed out)."""

    def __init__(self, code: grpc.StatusCode, details: str, timed_out: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.timed_out = timed_out  # no answer in time (a server that hangs), not a broken connection

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class SocketClient:
    """One connection, one call at a time (callers lock)."""

    def __init__(self, address: str | tuple[str, int], token: str | None, timeout_s: float,
                 connect_timeout_s: float | None = None) -> None:
        """`address`: a Unix socket's path (or abstract name, "\\0..."), or (host, port) of a TCP one."""
        connect_timeout_s = connect_timeout_s or timeout_s
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(connect_timeout_s)
            try:
                self._sock.connect(address)
                if address.startswith("\0") and peer_uid(self._sock) != os.getuid():
                    # an abstract name has no permissions: another user may have bound it first
                    raise PermissionError(f"socket {address[1:]!r} is served by another user")
            except BaseException:
                self._sock.close()
                raise
        else:
            self._sock = socket.create_connection(address, timeout=connect_timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.ask(Op.HELLO, (token or "").encode())
            self._sock.settimeout(timeout_s)
        except BaseException:
            self._sock.close()
            raise

    @classmethod
    def open(cls, path: str, token: str | None, timeout_s: float) -> "SocketClient | None":
        """A connection to the daemon's same-host socket at `path`, or None when
        it cannot be had (logged; the shared-memory calls then go through gRPC)."""
        try:
            return cls(path, token, timeout_s)
        except (OSError, grpc.RpcError) as e:
            logging.getLogger("tierkv.client").info("tierkv same-host socket %s unusable (%s); shared-memory "
                                                    "calls go through gRPC", path, e)
            return None

    def call(self, op: Op, request):
        """One call; the parsed reply (SPECS[op].reply), or SocketCallError."""
        self.post(op, request)
        return self.answer(op)

    def post(self, op: Op, request) -> None:
        """Send a call without waiting: the server answers calls in the order
        they came, so the caller reads each reply later with `answer`."""
        self.ask(op, request.SerializeToString(), wait=False)

    def answer(self, op: Op):
        """The parsed reply of the oldest call `post`ed and not yet answered."""
        return _parsed(op, self.reply())

    def call_fd(self, op: Op, request):
        """`call` for a reply that carries a file descriptor: (reply, fd); the
        caller owns the fd."""
        self.post(op, request)
        try:
            head, fds, _, _ = socket.recv_fds(self._sock, FRAME.size, 1)
            for fd in fds[1:]:
                os.close(fd)
        except OSError as e:
            raise _broken(e) from None
        try:
            if not head:
                raise SocketCallError(grpc.StatusCode.UNAVAILABLE, "socket: the server closed the connection")
            body = self._body(head + self._read(FRAME.size - len(head)))
            if not fds:
                raise SocketCallError(grpc.StatusCode.UNAVAILABLE, f"socket: {op.name} reply without its descriptor")
            return _parsed(op, body), fds[0]
        except BaseException:
            for fd in fds[:1]:
                os.close(fd)
            raise

    def ask(self, op: int, body: bytes, pieces=(), wait: bool = True) -> bytes | None:
        """Send a frame (and `pieces` of raw bytes after it); the reply's body
        (None without `wait`), or SocketCallError."""
        try:
            send(self._sock, op, body)
            for piece in pieces:
                self._sock.sendall(piece)
        except OSError as e:
            raise _broken(e) from None
        return self.reply() if wait else None

    def reply(self) -> bytes:
        """The next reply frame's body (a bulk op may answer with several), or SocketCallError."""
        head = self._read(FRAME.size, eof_ok=True)
        if head is None:
            raise SocketCallError(grpc.StatusCode.UNAVAILABLE, "socket: the server closed the connection")
        return self._body(head)

    def _body(self, head: bytes) -> bytes:
        """The body of the frame whose header is `head`; SocketCallError for an error status."""
        n, code = FRAME.unpack(head)
        if n > MAX_BODY:
            raise SocketCallError(grpc.StatusCode.UNAVAILABLE, f"socket: reply of {n} bytes exceeds {MAX_BODY}")
        body = self._read(n)
        if code != OK:
            raise SocketCallError(CODES.get(code, grpc.StatusCode.UNKNOWN), body.decode("utf-8", "replace"))
        return body

    def _read(self, n: int, eof_ok: bool = False) -> bytes | None:
        try:
            return exactly(self._sock, n, eof_ok)
        except OSError as e:  # includes timeouts: the server may still be at work on the call
            raise _broken(e) from None

    def recv_into(self, view: memoryview) -> None:
        """Exactly len(view) raw bytes that follow a reply (SocketCallError if they do not come)."""
        try:
            fill(self._sock, view)
        except OSError as e:
            raise _broken(e) from None

    def close(self) -> None:
        self._sock.close()


def _parsed(op: Op, body: bytes):
    try:
        return SPECS[op].reply.FromString(body)
    except Exception:  # protobuf's DecodeError: the connection cannot be trusted any more
        raise SocketCallError(grpc.StatusCode.UNAVAILABLE, f"socket: malformed {op.name} reply") from None


def _broken(e: OSError) -> SocketCallError:
    return SocketCallError(grpc.StatusCode.UNAVAILABLE, f"socket: {e or type(e).__name__}", isinstance(e, TimeoutError))
