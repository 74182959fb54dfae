"""The same-host doorbell: LoadShm and StoreShm over a Unix socket.

On this kind of machine a unary gRPC call costs the Python stack 0.7-1.4 ms
on top of its handler, about half the time of a 32 MiB shared-memory load.
The shared-memory calls only ring a bell (a ShmRequest of hashes and an
offset; the payloads are in the segment already), so the daemon also serves
them on a Unix socket whose path it gives in AttachReply.doorbell. The
socket file is mode 0600 in a private directory: only the daemon's user (who
must be the client's anyway, to map its segment) can connect.

Frames, both ways: little-endian u32 body length, u8 op (request) or status
code (reply), then the body: the request's / reply's protobuf, or the error
message. A connection opens with HELLO carrying the bearer token (empty
with auth off); the daemon resolves the tenant once and every later call on
that connection runs as it, through the same servicer methods, status codes
and metrics as gRPC (`cache_service.server.rpc.call_as`). A refused HELLO closes
the connection. `Bell` is the client end (cache_service/protocol/socket_client.py). The
daemon's shared pool is served here too (cache_service/server/pool.py): its memfd
travels with a reply (SCM_RIGHTS).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import grpc

from cache_service.protocol.frames import CALL_TIMEOUT_S, HELLO, HELLO_BODY, HELLO_TIMEOUT_S, LOAD_SHM, STORE_SHM, fill, receive, send
from cache_service.protocol.messages import RequestError
from cache_service.server.rpc import call_as, run_as
from proto import tierkv_pb2 as pb
from tiers.arena import Arena

log = logging.getLogger("tierkv.server")
OPS = {LOAD_SHM: ("LoadShm", pb.ShmRequest), STORE_SHM: ("StoreShm", pb.ShmRequest)}
class Connection:
    """What a bulk op may keep between the calls of one connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.arena = Arena()  # request-sized buffers, reused call after call
        self.unread = False  # a bulk op stopped before reading its bytes: the stream is out of step
        self.busy = False  # answering a call (close() lets it finish)
        self.fds: list[int] = []  # file descriptors to pass with the next reply (Unix sockets)
        self.on_close: list = []  # callbacks once the connection ends (what it holds is handed back)
        self.lease = None  # the shared-pool slots reserved on this connection (cache_service/server/pool.py)

    def send_part(self, reply, pieces) -> None:
        """An OK frame and raw pieces ahead of a bulk op's last reply (which
        `Doorbell` sends once the handler returns)."""
        try:
            send(self.sock, grpc.StatusCode.OK.value[0], reply.SerializeToString())
            for piece in pieces:
                self.sock.sendall(piece)
        except OSError as e:  # a cancelled call (the client left), not a daemon error
            raise RequestError(grpc.StatusCode.CANCELLED, f"the client went away mid-call ({e})") from None

    def read_into(self, view: memoryview) -> None:
        """Exactly len(view) raw bytes from the client."""
        try:
            fill(self.sock, view)
        except OSError as e:  # answered as a cancelled call (nothing is kept of it), not as a daemon error
            raise RequestError(grpc.StatusCode.CANCELLED, f"the client went away mid-call ({e})") from None

    def discard(self, nbytes: int) -> None:
        """Read and drop the nbytes a refused call's frame announced, so the connection stays in step."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes > 0:
            self.read_into(scratch[:min(nbytes, len(scratch))])
            nbytes -= len(scratch)
        self.unread = False


class Doorbell:
    """The daemon end: a listening socket and one thread per connection.

    By default a Unix socket in a private directory (`path`); given a bound
    TCP `listener` it serves that instead (the streamed data lane,
    cache_service/server/data_path.py). `bulk` maps ops to (method name, handler): a
    handler(servicer, Connection, body, tenant) reads any bytes that follow
    its frame and returns (reply, pieces to send after the reply frame)."""

    def __init__(self, servicer, listener: socket.socket | None = None, bulk: dict | None = None,
                 max_connections: int = 256) -> None:
        self.servicer, self.max_connections, self.bulk = servicer, max_connections, bulk or {}
        self.ops = OPS if listener is None else {}  # the shared-memory calls: same host only
        self._dir, self.path = None, ""
        if listener is None:
            self._dir = Path(tempfile.mkdtemp(prefix="tierkv-bell-"))  # mode 0700
            self.path = str(self._dir / "sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.path)
            os.chmod(self.path, 0o600)
        self._listener = listener
        self._listener.listen(64)
        self._conns: dict[socket.socket, tuple[threading.Thread, Connection]] = {}
        self._lock = threading.Lock()
        self._closing = False
        self.calls = 0  # calls answered (tests, stats)
        self._acceptor = threading.Thread(target=self._accept, name="tierkv-bell", daemon=True)

    def start(self) -> "Doorbell":
        self._acceptor.start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closing:
                    return
                log.warning("doorbell: accept failed (%s); retrying", e)  # EMFILE, ECONNABORTED, ...
                time.sleep(0.1)
                continue
            with self._lock:
                if self._closing or len(self._conns) >= self.max_connections:
                    conn.close()
                    continue
                state = Connection(conn)
                t = threading.Thread(target=self._serve, args=(state,), name="tierkv-bell-conn", daemon=True)
                self._conns[conn] = (t, state)
                t.start()

    def _serve(self, state: Connection) -> None:
        conn = state.sock
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            tenant = self._hello(conn)
            while tenant is not False and not state.unread and not self._closing:
                conn.settimeout(None)  # idle between calls as long as the client likes
                frame = receive(conn)
                if frame is None:
                    break
                conn.settimeout(CALL_TIMEOUT_S)
                state.busy = True
                self._answer(state, *frame, tenant)
                state.busy = False
        except OSError as e:  # the client went away (or close() shut the socket): nothing to answer
            log.debug("doorbell connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            for done in state.on_close:
                try:
                    done()
                except Exception:  # the dispatch boundary: log, never kill the daemon
                    log.exception("doorbell: cleanup after a connection failed")

    def _answer(self, state: Connection, op: int, body: bytes, tenant: str | None) -> None:
        pieces: list = []
        if op in self.bulk:
            name, handler = self.bulk[op]
            result, code, msg = run_as(self.servicer, name, tenant, lambda t: handler(self.servicer, state, body, t))
            reply, pieces = result if result is not None else (None, [])
        elif op in self.ops:
            reply, code, msg = call_as(self.servicer, *self.ops[op], body, tenant)
        else:  # bytes of its own may follow it: the connection ends after the answer
            reply, code, msg = None, grpc.StatusCode.UNIMPLEMENTED, f"doorbell: no op {op} here"
            state.unread = True
        with self._lock:
            self.calls += 1
        fds, state.fds = state.fds, []
        try:  # the fds are the handler's to give: closed once sent (or not, after an error)
            send(state.sock, code.value[0], reply.SerializeToString() if reply is not None else msg.encode(),
                 fds if reply is not None else None)
        finally:
            for fd in fds:
                os.close(fd)
        for piece in pieces:
            state.sock.sendall(piece)

    def _hello(self, conn: socket.socket) -> str | None | bool:
        """The connection's tenant, or False after refusing its HELLO."""
        frame = receive(conn, HELLO_BODY)
        if frame is None:
            return False
        op, body = frame
        try:
            if op != HELLO:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "doorbell: the first frame must be HELLO")
            token = body.decode("utf-8", "replace")
            tenant = self.servicer.auth.tenant_of([("authorization", f"Bearer {token}")] if token else [])
        except RequestError as e:  # counted and logged as gRPC's interceptor does a refused token
            self.servicer.metrics.observe("Hello", None, e.code, 0.0)
            log.info("doorbell refused a connection", extra={"fields": {"code": e.code.name, "error": str(e)}})
            send(conn, e.code.value[0], str(e).encode())
            return False
        send(conn, grpc.StatusCode.OK.value[0], b"")
        return tenant

    def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting; calls in flight finish (up to grace_s), idle connections end."""
        with self._lock:
            self._closing = True
            conns = dict(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn, (_, state) in conns.items():
            if not state.busy:  # a thread waiting for a frame wakes up; one mid-call finishes it first
                try:
                    conn.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
        deadline = time.monotonic() + grace_s
        for t, _ in conns.values():
            t.join(max(0.0, deadline - time.monotonic()))
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
