"""The server end of tierkv's framed sockets (frame format: protocol/frames.py,
ops: protocol/ops.py): `FramedServer`, a listener (a Unix socket in a
private directory, an abstract Unix name, or a bound TCP socket) with one
thread per connection, and `Connection`, what a handler sees of its
connection.

A connection opens with HELLO; the `hello` callback turns its body into
the connection's peer (a tenant, say) or raises RequestError, which is
answered and ends the connection. Every later frame goes to
`dispatch(connection, op, body, peer) -> (status, reply body, raw pieces)`;
the reply frame carries `connection.fds` (SCM_RIGHTS) when the status is OK.
Users: the daemon's same-host socket and TCP data path
(cache_service/server/socket_server.py), the vLLM lookups
(connectors/vllm/lookup.py)."""
from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import grpc

from cache_service.protocol.frames import CALL_TIMEOUT_S, HELLO_BODY, HELLO_TIMEOUT_S, OK, fill, peer_uid, receive, send
from cache_service.protocol.messages import RequestError
from cache_service.protocol.ops import Op
from tiers.arena import Arena

log = logging.getLogger("tierkv.server")
ARENA_IDLE_S = 1.0  # a connection quiet this long lets its buffers go (hundreds of idle ones held GiBs)
Dispatch = Callable[["Connection", int, bytes, object], tuple[grpc.StatusCode, bytes, list]]


class Connection:
    """What a handler may keep between the calls of one connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.arena = Arena()  # request-sized buffers, reused call after call
        self.unread = False  # a bulk op stopped before reading its bytes: the stream is out of step
        self.busy = False  # answering a call (close() lets it finish)
        self.fds: list[int] = []  # file descriptors to pass with the next reply (Unix sockets)
        self.on_close: list = []  # callbacks once the connection ends (what it holds is handed back)
        self.kept: dict[str, object] = {}  # what handlers keep for the connection's life (the pool's Lease, Holds)
        self.deadline: float | None = None  # when the call being answered must have had all its bytes
        self.peer: object = _GREETING  # what the HELLO made of the peer, once it came
        self.opened = time.monotonic()

    def send_part(self, reply, pieces) -> None:
        """An OK frame and raw pieces ahead of a bulk op's last reply (which
        the server sends once the handler returns)."""
        try:
            send(self.sock, OK, reply.SerializeToString())
            for piece in pieces:
                self.sock.sendall(piece)
        except OSError as e:  # a cancelled call (the client left), not a server error
            raise RequestError(grpc.StatusCode.CANCELLED, f"the client went away mid-call ({e})") from None

    def read_into(self, view: memoryview) -> None:
        """Exactly len(view) raw bytes from the client."""
        try:
            fill(self.sock, view, deadline=self.deadline)
        except OSError as e:  # answered as a cancelled call (nothing is kept of it), not as a server error
            raise RequestError(grpc.StatusCode.CANCELLED, f"the client went away mid-call ({e})") from None
        finally:
            self.sock.settimeout(CALL_TIMEOUT_S)  # for the reply: fill left the time its deadline had left

    def discard(self, nbytes: int) -> None:
        """Read and drop the nbytes a refused call's frame announced, so the connection stays in step."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes > 0:
            self.read_into(scratch[:min(nbytes, len(scratch))])
            nbytes -= len(scratch)
        self.unread = False


def private_unix_listener(prefix: str = "tierkv-socket-") -> tuple[socket.socket, Path]:
    """A Unix socket `sock` (mode 0600) in a new private directory (mode 0700,
    named after this process): only this user can connect. (listener,
    directory); the caller removes the directory. Directories that processes
    killed before they could remove theirs left behind are removed first."""
    _remove_stale(prefix)
    where = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(where / "sock"))
    os.chmod(where / "sock", 0o600)
    return listener, where


def _remove_stale(prefix: str) -> None:
    """Remove this user's `prefix<pid>-*` directories whose process is gone."""
    for where in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = where.name[len(prefix):].split("-", 1)[0]
        try:
            if not pid.isdigit() or where.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its process is gone: nobody can be listening there
            shutil.rmtree(where, ignore_errors=True)
        except OSError:  # alive (another user's: EPERM), or gone meanwhile
            continue


def _is_own_user(conn: socket.socket) -> bool:
    try:
        return peer_uid(conn) == os.getuid()
    except OSError:
        return False


def abstract_listener(name: str) -> socket.socket:
    """A Unix socket bound to an abstract name ("\\0..."): no file, gone with the process."""
    assert name.startswith("\0")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    return listener


class FramedServer:
    """A framed-socket server: one thread per connection, at most
    `max_connections` at once: three quarters at most of one named peer (a
    tenant cannot lock the others out), a quarter at most still before their
    HELLO (the oldest such is dropped for a newcomer);
    a HELLO must come whole within HELLO_TIMEOUT_S and a call's bytes within
    CALL_TIMEOUT_S of its header; `close` drains (see the module doc)."""

    def __init__(self, listener: socket.socket, hello: Callable[[bytes], object], dispatch: Dispatch,
                 max_connections: int = 256, name: str = "tierkv-socket", owned_dir: Path | None = None,
                 same_user: bool = False) -> None:
        """`same_user`: only processes of this user connect (an abstract name has no file permissions)."""
        self.hello, self.dispatch, self.max_connections, self.name = hello, dispatch, max_connections, name
        self.same_user = same_user
        self._dir = owned_dir  # removed on close
        self.path = str(owned_dir / "sock") if owned_dir is not None else ""
        self._listener = listener
        self._listener.listen(64)
        self._conns: dict[socket.socket, tuple[threading.Thread, Connection]] = {}
        self._lock = threading.Lock()
        self._closing = False
        self.calls = 0  # calls answered (tests, stats)
        self._acceptor = threading.Thread(target=self._accept, name=name, daemon=True)

    def start(self) -> "FramedServer":
        self._acceptor.start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closing:
                    return
                log.warning("%s: accept failed (%s); retrying", self.name, e)  # EMFILE, ECONNABORTED, ...
                time.sleep(0.1)
                continue
            if self.same_user and not _is_own_user(conn):
                conn.close()
                continue
            with self._lock:
                if self._closing or len(self._conns) >= self.max_connections:
                    conn.close()
                    continue
                self._make_room_to_greet()
                state = Connection(conn)
                t = threading.Thread(target=self._serve, args=(state,), name=f"{self.name}-conn", daemon=True)
                self._conns[conn] = (t, state)
                try:
                    t.start()
                except Exception as e:  # out of threads (RuntimeError), memory: refuse this one, keep accepting
                    del self._conns[conn]
                    conn.close()
                    log.warning("%s: cannot serve a connection (%s)", self.name, e)
                    time.sleep(0.1)

    @property
    def _share(self) -> int:
        return max(1, self.max_connections // 4)

    def _make_room_to_greet(self) -> None:
        """Caller holds the lock: past a quarter of the connections still
        before their HELLO, the oldest of those is dropped (a real client's
        HELLO comes within milliseconds; a peer trickling one takes the place)."""
        greeting = [st for _, st in self._conns.values() if st.peer is _GREETING]
        if len(greeting) >= self._share:
            oldest = min(greeting, key=lambda st: st.opened)
            try:
                oldest.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _serve(self, state: Connection) -> None:
        conn = state.sock
        try:
            peer = self._hello(state)
            while peer is not _REFUSED and not state.unread and not self._closing:
                conn.settimeout(None)  # idle between calls as long as the client likes
                if state.arena.holding and not _readable(conn, ARENA_IDLE_S):
                    state.arena.release()  # an idle connection keeps no request-sized buffer
                frame = receive(conn, body_s=CALL_TIMEOUT_S)
                if frame is None:
                    break
                state.deadline = time.monotonic() + CALL_TIMEOUT_S  # the objects a bulk call reads after it
                conn.settimeout(CALL_TIMEOUT_S)
                state.busy = True
                self._answer(state, *frame, peer)
                state.busy = False
        except OSError as e:  # the client went away (or close() shut the socket): nothing to answer
            log.debug("%s connection ended: %s", self.name, e)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            for done in state.on_close:
                try:
                    done()
                except Exception:  # the dispatch boundary: log, never kill the server
                    log.exception("%s: cleanup after a connection failed", self.name)

    def _answer(self, state: Connection, op: int, body: bytes, peer) -> None:
        code, reply, pieces = self.dispatch(state, op, body, peer)
        with self._lock:
            self.calls += 1
        fds, state.fds = state.fds, []
        try:  # the fds are the handler's to give: closed once sent (or not, after an error)
            send(state.sock, code.value[0], reply, fds if code == grpc.StatusCode.OK else None)
        finally:
            for fd in fds:
                os.close(fd)
        for piece in pieces:
            state.sock.sendall(piece)

    def _hello(self, state: Connection):
        """The connection's peer (what `hello` made of the HELLO), or _REFUSED."""
        conn = state.sock
        frame = receive(conn, HELLO_BODY, deadline=time.monotonic() + HELLO_TIMEOUT_S)
        if frame is None:
            return _REFUSED
        op, body = frame
        try:
            if op != Op.HELLO:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name}: the first frame must be HELLO")
            peer = self.hello(body)
            with self._lock:  # counted and taken at once: two connections of one tenant cannot both pass
                mine = sum(s.peer == peer for _, s in self._conns.values() if s.peer is not _GREETING)
                if isinstance(peer, str) and mine >= self.max_connections - self.max_connections // 4:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"{self.name}: {mine} connections of this tenant already; close one first")
                state.peer = peer
        except RequestError as e:
            send(conn, e.code.value[0], str(e).encode())
            return _REFUSED
        send(conn, OK, b"")
        return peer

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
            if t.ident is not None:  # started
                t.join(max(0.0, deadline - time.monotonic()))
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


_REFUSED = object()  # a peer whose HELLO was refused
_GREETING = object()  # a connection whose HELLO has not come yet


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has bytes (or its end) within `timeout_s`; poll, not
    select, which refuses descriptors past 1024."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(timeout_s * 1000))
