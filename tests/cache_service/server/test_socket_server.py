"""The same-host socket: the shared-memory calls over a Unix socket, with
gRPC's auth, tenants and status codes, and a fallback to gRPC."""
from __future__ import annotations

import os
import random
import socket

import grpc
import pytest

from cache_service.protocol.ops import Op
from cache_service.protocol.socket_client import SocketCallError, SocketClient
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, hashes
from tests.cache_service.server.test_servicer import TOKENS, intact, put, start, url  # noqa: F401 (fixture)

Code = grpc.StatusCode


def _refused(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(SocketCallError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_shared_memory_calls_use_the_same_host_socket(start):
    d = start()
    with GrpcClient(url(d, "shm")) as c:
        # the daemon offered its socket at Attach and the client connected
        assert c._near.socket is not None and d.servicer.socket_path == d.same_host_server.path
        # a store and a load are answered there, not by gRPC, and counted as the same methods
        # (after asking once for the daemon's pool, which this daemon does not share)
        hs = hashes(6)
        assert put(c, hs) == 6 and intact(c, hs)
        assert d.same_host_server.calls == 3 and c._near.pool_refused
    # only the daemon's user may connect
    assert os.stat(d.same_host_server.path).st_mode & 0o777 == 0o600


def test_the_same_host_socket_checks_tokens_and_attachment_tenants(start):
    d = start(auth=True)
    # no token or a wrong one: refused at HELLO
    assert _refused(lambda: SocketClient(d.same_host_server.path, None, 5.0))[0] == Code.UNAUTHENTICATED
    assert _refused(lambda: SocketClient(d.same_host_server.path, "not-a-token-at-all", 5.0))[0] == Code.UNAUTHENTICATED
    with GrpcClient(url(d, "shm"), token=TOKENS["acme"]) as acme:
        assert put(acme, hashes(3)) == 3
        # globex holding acme's attachment id still cannot use it
        globex = SocketClient(d.same_host_server.path, TOKENS["globex"], 5.0)
        try:
            req = pb.ShmRequest(ns=ns_to_pb(NS), hashes=hashes(3), attachment=acme._near.attachment)
            code, why = _refused(lambda: globex.call(Op.LOAD_SHM, req))
            assert code == Code.PERMISSION_DENIED and "tenant" in why
        finally:
            globex.close()
        assert intact(acme, hashes(3))


def test_bad_frames_get_status_codes_and_never_crash_the_daemon(start):
    d = start()
    with GrpcClient(url(d, "shm")) as c:
        assert put(c, hashes(4)) == 4
        sock = SocketClient(d.same_host_server.path, None, 5.0)
        try:
            # a malformed body and an unknown attachment are refused; the connection goes on
            assert _refused(lambda: sock.ask(Op.LOAD_SHM, b"\xff\xff\xff"))[0] == Code.INVALID_ARGUMENT
            req = pb.ShmRequest(ns=ns_to_pb(NS), hashes=hashes(4), attachment="nope")
            assert _refused(lambda: sock.call(Op.LOAD_SHM, req))[0] == Code.NOT_FOUND
            # an unknown op (bytes of its own may follow it) is refused, then the connection ends
            assert _refused(lambda: sock.ask(99, b""))[0] == Code.UNIMPLEMENTED
            assert _refused(lambda: sock.call(Op.LOAD_SHM, req))[0] == Code.UNAVAILABLE
            # the data path's ops are not served on the same-host socket, nor the same-host socket's on the data path
            assert _refused(lambda: SocketClient(d.same_host_server.path, None, 5.0).ask(3, b""))[0] == Code.UNIMPLEMENTED
            data_path = SocketClient(("127.0.0.1", d.servicer.data_port), None, 5.0)
            assert _refused(lambda: data_path.call(Op.LOAD_SHM, req))[0] == Code.UNIMPLEMENTED
            data_path.close()
        finally:
            sock.close()
        # random bytes on fresh connections: each is answered or dropped, the daemon keeps serving
        rng = random.Random(0)
        for _ in range(200):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5.0)
                s.connect(d.same_host_server.path)
                s.sendall(rng.randbytes(rng.randrange(1, 64)))
                s.shutdown(socket.SHUT_WR)
                try:
                    while s.recv(4096):
                        pass
                except ConnectionResetError:  # dropped with bytes unread: fine
                    pass
        # nothing stored was lost, and the client's own same-host socket still works
        assert intact(c, hashes(4)) and d.same_host_server.calls >= 2


def test_a_broken_same_host_socket_costs_one_miss_then_grpc_carries_the_calls(start):
    d = start()
    with GrpcClient(url(d, "shm")) as c:
        hs = hashes(4)
        assert put(c, hs) == 4
        # the daemon's same-host socket goes away (its connections with it)
        d.servicer.socket_path = ""
        d.same_host_server.close(grace_s=1.0)
        # the call in the way is a miss, not an error in the caller
        assert c.load(NS, hs) == [None] * 4 and c.errors == 1
        # the client attaches again, without a same-host socket now, and shared memory works through gRPC
        c._retry_at = 0.0
        assert intact(c, hs) and c.transport == "shm" and c._near.socket is None


def test_no_same_host_socket_means_shared_memory_through_grpc(start, monkeypatch):
    # the daemon cannot open its same-host socket (a full /run, say)
    def refuse(prefix):
        raise OSError("no room for a socket")
    monkeypatch.setattr("cache_service.server.socket_server.private_unix_listener", refuse)
    d = start()
    assert d.same_host_server is None and d.servicer.socket_path == ""
    with GrpcClient(url(d, "shm")) as c:
        # Attach still answers, offering no socket; the shared-memory calls go through gRPC
        assert c._near.socket is None
        hs = hashes(4)
        assert put(c, hs) == 4 and intact(c, hs)
