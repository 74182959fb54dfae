"""The daemon's framed-socket servers: the same-host socket (LoadShm,
StoreShm and the shared pool's ops over a Unix socket) and the TCP data
path (cache_service/server/data_path.py), both a `protocol.socket_server.FramedServer`.

On this kind of machine a unary gRPC call costs the Python stack 0.7-1.4 ms
on top of its handler, about half the time of a 32 MiB shared-memory load.
The shared-memory calls only name blocks (a ShmRequest of hashes and an
offset; the payloads are in the segment already), so the daemon also serves
them on a Unix socket whose path it gives in AttachReply.socket_path. The
socket file is mode 0600 in a private directory: only the daemon's user (who
must be the client's anyway, to map its segment) can connect.

A connection opens with HELLO carrying the bearer token (empty with auth
off); the daemon resolves the tenant once and every later call on that
connection runs as it, through the same servicer methods, status codes and
metrics as gRPC (`cache_service.server.rpc.call_as`). A refused HELLO closes
the connection. The client end is `protocol.socket_client.SocketClient`.
The daemon's shared pool is served here too (cache_service/server/pool.py):
its memfd travels with a reply (SCM_RIGHTS).
"""
from __future__ import annotations

import logging
import socket

import grpc

from cache_service.protocol.messages import RequestError
from cache_service.protocol.ops import SPECS, Op
from cache_service.protocol.socket_server import Connection, FramedServer, private_unix_listener
from cache_service.server.rpc import call_as, run_as

log = logging.getLogger("tierkv.server")
SHM_OPS = (Op.LOAD_SHM, Op.STORE_SHM)  # unary servicer calls: same host only


class DaemonSocketServer(FramedServer):
    """The daemon end of a framed socket. By default the same-host Unix
    socket in a private directory (`path`); given a bound TCP `listener` it
    serves that instead (the TCP data path). `bulk` maps ops to handlers:
    handler(servicer, Connection, body, tenant) reads any bytes that follow
    its frame and returns (reply, pieces to send after the reply frame)."""

    def __init__(self, servicer, listener: socket.socket | None = None, bulk: dict | None = None,
                 max_connections: int = 256) -> None:
        self.servicer, self.bulk = servicer, bulk or {}
        self.unary = SHM_OPS if listener is None else ()
        where = None
        if listener is None:
            listener, where = private_unix_listener("tierkv-socket-")
        super().__init__(listener, self._tenant, self._dispatch, max_connections,
                         name="tierkv-same-host" if where is not None else "tierkv-data-path", owned_dir=where)

    def _tenant(self, body: bytes) -> str | None:
        """The HELLO's token as a tenant; counted and logged as gRPC's interceptor does a refused token."""
        token = body.decode("utf-8", "replace")
        try:
            return self.servicer.auth.tenant_of([("authorization", f"Bearer {token}")] if token else [])
        except RequestError as e:
            self.servicer.metrics.observe("Hello", None, e.code, None)
            log.info("%s refused a connection", self.name, extra={"fields": {"code": e.code.name, "error": str(e)}})
            raise

    def _dispatch(self, conn: Connection, op: int, body: bytes, tenant: str | None):
        pieces: list = []
        if op in self.bulk:
            handler = self.bulk[op]
            result, code, msg = run_as(self.servicer, SPECS[op].method, tenant,
                                       lambda t: handler(self.servicer, conn, body, t))
            reply, pieces = result if result is not None else (None, [])
        elif op in self.unary:
            reply, code, msg = call_as(self.servicer, SPECS[op].method, SPECS[op].request, body, tenant)
        else:  # bytes of its own may follow it: the connection ends after the answer
            reply, code, msg = None, grpc.StatusCode.UNIMPLEMENTED, f"{self.name}: no op {op} here"
            conn.unread = True
        return code, (reply.SerializeToString() if reply is not None else msg.encode()), pieces
