"""The client end of the doorbell (cache_service/server/socket_server.py) and of the
data lane (cache_service/server/data_path.py): `Bell`, one connection that rings calls
and reads their replies, and `BellError`, which is a grpc.RpcError so
callers handle both paths alike."""
from __future__ import annotations

import logging
import os
import socket

import grpc

from cache_service.protocol.frames import FRAME, HELLO, MAX_BODY, NAMES, CODES, exactly, fill, send


class BellError(grpc.RpcError):
    """A doorbell call that failed: the status the daemon answered, or
    UNAVAILABLE when the connection broke (or timed out)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Bell:
    """The client end: one connection, one call at a time (callers lock)."""

    def __init__(self, address: str | tuple[str, int], token: str | None, timeout_s: float,
                 connect_timeout_s: float | None = None) -> None:
        """`address`: a Unix socket's path, or (host, port) of a TCP one."""
        connect_timeout_s = connect_timeout_s or timeout_s
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(connect_timeout_s)
            self._sock.connect(address)
        else:
            self._sock = socket.create_connection(address, timeout=connect_timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.ask(HELLO, (token or "").encode())
            self._sock.settimeout(timeout_s)
        except BaseException:
            self._sock.close()
            raise

    @classmethod
    def open(cls, path: str, token: str | None, timeout_s: float) -> "Bell | None":
        """A connection to the doorbell at `path`, or None when it cannot be
        had (logged; the shared-memory calls then go through gRPC)."""
        try:
            return cls(path, token, timeout_s)
        except (OSError, grpc.RpcError) as e:
            logging.getLogger("tierkv.client").info("tierkv doorbell %s unusable (%s); shared-memory calls go "
                                                    "through gRPC", path, e)
            return None

    def call(self, name: str, request, reply_type):
        """One shared-memory call; the parsed reply, or BellError."""
        self.post(name, request)
        return self.answer(name, reply_type)

    def post(self, name: str, request) -> None:
        """Send a call without waiting: the daemon answers calls in the order
        they came, so the caller reads each reply later with `answer`."""
        self.ask(NAMES[name], request.SerializeToString(), wait=False)

    def answer(self, name: str, reply_type):
        """The parsed reply of the oldest call `post`ed and not yet answered."""
        return _parsed(name, reply_type, self.reply())

    def call_fd(self, name: str, request, reply_type):
        """`call` for a reply that carries a file descriptor: (reply, fd); the
        caller owns the fd."""
        self.post(name, request)
        try:
            head, fds, _, _ = socket.recv_fds(self._sock, FRAME.size, 1)
            for fd in fds[1:]:
                os.close(fd)
        except OSError as e:
            raise _broken(e) from None
        try:
            if not head:
                raise BellError(grpc.StatusCode.UNAVAILABLE, "doorbell: the daemon closed the connection")
            body = self._body(head + self._read(FRAME.size - len(head)))
            if not fds:
                raise BellError(grpc.StatusCode.UNAVAILABLE, f"doorbell: {name} reply without its descriptor")
            return _parsed(name, reply_type, body), fds[0]
        except BaseException:
            for fd in fds[:1]:
                os.close(fd)
            raise

    def ask(self, op: int, body: bytes, pieces=(), wait: bool = True) -> bytes | None:
        """Send a frame (and `pieces` of raw bytes after it); the reply's body
        (None without `wait`), or BellError."""
        try:
            send(self._sock, op, body)
            for piece in pieces:
                self._sock.sendall(piece)
        except OSError as e:
            raise _broken(e) from None
        return self.reply() if wait else None

    def reply(self) -> bytes:
        """The next reply frame's body (a bulk op may answer with several), or BellError."""
        head = self._read(FRAME.size, eof_ok=True)
        if head is None:
            raise BellError(grpc.StatusCode.UNAVAILABLE, "doorbell: the daemon closed the connection")
        return self._body(head)

    def _body(self, head: bytes) -> bytes:
        """The body of the frame whose header is `head`; BellError for an error status."""
        n, code = FRAME.unpack(head)
        if n > MAX_BODY:
            raise BellError(grpc.StatusCode.UNAVAILABLE, f"doorbell: reply of {n} bytes exceeds {MAX_BODY}")
        body = self._read(n)
        if code != grpc.StatusCode.OK.value[0]:
            raise BellError(CODES.get(code, grpc.StatusCode.UNKNOWN), body.decode("utf-8", "replace"))
        return body

    def _read(self, n: int, eof_ok: bool = False) -> bytes | None:
        try:
            return exactly(self._sock, n, eof_ok)
        except OSError as e:  # includes timeouts: the daemon may still be at work on the segment
            raise _broken(e) from None

    def recv_into(self, view: memoryview) -> None:
        """Exactly len(view) raw bytes that follow a reply (BellError if they do not come)."""
        try:
            fill(self._sock, view)
        except OSError as e:
            raise _broken(e) from None

    def close(self) -> None:
        self._sock.close()


def _parsed(name: str, reply_type, body: bytes):
    try:
        return reply_type.FromString(body)
    except Exception:  # protobuf's DecodeError: the connection cannot be trusted any more
        raise BellError(grpc.StatusCode.UNAVAILABLE, f"doorbell: malformed {name} reply") from None


def _broken(e: OSError) -> BellError:
    return BellError(grpc.StatusCode.UNAVAILABLE, f"doorbell: {e or type(e).__name__}")
