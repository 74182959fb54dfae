"""The streamed data path: Load and Store as raw bytes over TCP, with gRPC's
auth, tenants and status codes; bad bytes store nothing; gRPC takes over
when the data path is off or breaks."""
from __future__ import annotations

import socket
import time

import grpc
import pytest

from cache_service.protocol import frames
from cache_service.protocol.ops import Op
from connectors.grpc.data_path import DataPathClient
from cache_service.blocks.objects import HEADER_SIZE, encode, object_size
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, hashes, payload_for, same
from tests.cache_service.server.test_socket_server import _refused
from tests.cache_service.server.test_servicer import TOKENS, intact, put, start, url  # noqa: F401 (fixture)

Code = grpc.StatusCode
S = object_size(NS)


def _data_path(d, token: str | None = None) -> DataPathClient:
    return DataPathClient("127.0.0.1", d.servicer.data_port, token, 10.0, 64 * S)


def test_streaming_clients_move_bytes_over_the_data_path(start):
    d = start()
    with GrpcClient(url(d, "stream")) as c:
        # the daemon announced its data path; a store and a load go over it, not over gRPC
        assert c.hello.data_port == d.servicer.data_port > 0
        hs = hashes(12)
        assert put(c, hs) == 12 and intact(c, hs)
        assert d.data_path_server.calls == 2
        # misses keep their positions
        assert [p is not None for p in c.load(NS, [hs[0], *hashes(2, start=900), hs[5]])] == [True, False, False, True]


def test_no_data_path_when_turned_off(start):
    # data_port None: Hello announces none and the client streams through gRPC
    d = start(data_port=None)
    assert d.data_path_server is None and d.servicer.data_port == 0
    with GrpcClient(url(d, "stream")) as c:
        assert c._data_path is None and put(c, hashes(3)) == 3 and intact(c, hashes(3))


def test_the_data_path_checks_tokens_and_keeps_tenants_apart(start):
    d = start(auth=True)
    # no token or a wrong one: refused at HELLO
    assert _refused(lambda: _data_path(d))[0] == Code.UNAUTHENTICATED
    assert _refused(lambda: _data_path(d, "not-a-token-at-all"))[0] == Code.UNAUTHENTICATED
    acme, globex = _data_path(d, TOKENS["acme"]), _data_path(d, TOKENS["globex"])
    try:
        # acme's blocks: found by acme under its own hashes, never by globex with the same hashes
        hs = hashes(4)
        assert acme.store(NS, hs, [payload_for(h) for h in hs]) == 4
        assert all(same(p, payload_for(h)) for p, h in zip(acme.load(NS, hs), hs))
        assert globex.load(NS, hs) == [None] * 4
        # naming acme's namespace does not help globex, to load or to store
        evil = pb.LoadRequest(ns=ns_to_pb(NS.with_tenant("acme")), hashes=hs).SerializeToString()
        code, why = _refused(lambda: globex._socket.ask(Op.LOAD, evil))
        assert code == Code.PERMISSION_DENIED and "tenant" in why
        acme_ns = NS.with_tenant("acme")
        head = pb.StoreChunk(ns=ns_to_pb(acme_ns), hashes=hs).SerializeToString()
        objs = [encode(acme_ns, h, payload_for(h)).numpy() for h in hs]
        assert _refused(lambda: globex._socket.ask(Op.STORE, head, objs))[0] == Code.PERMISSION_DENIED
        # the refused store's bytes were read and dropped: the same connection serves globex's next call
        assert globex.store(NS, hs[:1], [payload_for(hs[0])]) == 1
    finally:
        acme.close()
        globex.close()


@pytest.mark.parametrize("shared", [False, True])
def test_a_bad_object_stores_nothing_and_the_connection_goes_on(start, shared):
    # with a shared pool the daemon copies objects into reserved slots as it checks them: those go back too
    d = start(shared=shared)
    free = d.store.tiers[0].free_bytes()
    data_path = _data_path(d)
    try:
        hs = hashes(3)
        objs = [encode(NS, h, payload_for(h)) for h in hs]
        objs[1][HEADER_SIZE + 7] ^= 1  # one payload bit flipped after encoding
        head = pb.StoreChunk(ns=ns_to_pb(NS), hashes=hs).SerializeToString()
        code, why = _refused(lambda: data_path._socket.ask(Op.STORE, head, [o.numpy() for o in objs]))
        assert code == Code.INVALID_ARGUMENT and "checksum" in why
        assert d.store.lookup(hs) == 0 and d.store.tiers[0].free_bytes() == free
        # the daemon read the whole call, so the same connection serves the next one
        assert data_path.store(NS, hs, [payload_for(h) for h in hs]) == 3
        assert all(same(p, payload_for(h)) for p, h in zip(data_path.load(NS, hs), hs))
    finally:
        data_path.close()


def test_calls_past_the_batch_size_are_refused_and_clients_split_them(start):
    d = start(cpu_blocks=64, load_batch_bytes=3 * S)
    # a raw call over the batch size: RESOURCE_EXHAUSTED
    data_path = _data_path(d)
    try:
        big = pb.LoadRequest(ns=ns_to_pb(NS), hashes=hashes(4)).SerializeToString()
        assert _refused(lambda: data_path._socket.ask(Op.LOAD, big))[0] == Code.RESOURCE_EXHAUSTED
    finally:
        data_path.close()
    # the client splits by the batch size the daemon announced
    with GrpcClient(url(d, "stream")) as c:
        assert c.hello.data_batch_bytes == 3 * S
        assert put(c, hashes(10)) == 10 and intact(c, hashes(10))
    # blocks bigger than the data path's batch go through gRPC
    small = start(load_batch_bytes=S - 1)
    with GrpcClient(url(small, "stream")) as c:
        assert put(c, hashes(2)) == 2 and intact(c, hashes(2)) and small.data_path_server.calls == 0


def test_a_client_vanishing_mid_store_stores_nothing(start):
    d = start()
    hs = hashes(4)
    head = pb.StoreChunk(ns=ns_to_pb(NS), hashes=hs).SerializeToString()
    # HELLO, the STORE frame and half the objects, then the client is gone
    with socket.create_connection(("127.0.0.1", d.servicer.data_port), timeout=10) as s:
        frames.send(s, Op.HELLO, b"")
        assert frames.receive(s)[0] == 0
        frames.send(s, Op.STORE, head)
        s.sendall(b"".join(encode(NS, h, payload_for(h)).numpy().tobytes() for h in hs[:2]))
    # nothing stored (the call counts as cancelled, not as a daemon error), and the data path still serves others
    deadline = time.monotonic() + 5
    while d.data_path_server.calls < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.store.lookup(hs) == 0
    with GrpcClient(url(d, "stream")) as c:
        assert put(c, hs) == 4 and intact(c, hs)


def test_a_broken_data_path_is_one_miss_then_grpc_carries_the_calls(start):
    d = start()
    with GrpcClient(url(d, "stream")) as c:
        hs = hashes(4)
        assert put(c, hs) == 4
        # the daemon's data path goes away (its connections with it)
        d.data_path_server.close(grace_s=1.0)
        # the call in the way is a miss, not an error in the caller
        assert c.load(NS, hs) == [None] * 4 and c.errors == 1
        # until the data path is tried again, streaming goes through gRPC
        assert intact(c, hs) and put(c, hashes(2, start=50)) == 2


def test_a_client_follows_a_restarted_daemon_to_its_new_data_path_and_limits(tmp_path):
    from cache_service.config import ServerConfig
    from cache_service.server.daemon import Daemon
    from tests.cache_service.store.store_helpers import make_store

    def daemon(name: str, listen: str, **settings) -> Daemon:
        return Daemon(make_store(tmp_path / name), ServerConfig(listen=listen, sessions_dir=str(tmp_path / "s"),
                                                                **settings)).start()

    first = daemon("a", "127.0.0.1:0")
    c = GrpcClient(url(first, "stream"))
    second = None
    try:
        assert put(c, hashes(4)) == 4 and first.data_path_server.calls == 1
        # The daemon restarts on the same address: its data path on another port, fewer blocks per call.
        old_port = first.servicer.data_port
        first.stop(grace_s=0)
        second = daemon("b", first.address, max_blocks=64)
        assert second.servicer.data_port != old_port
        c._data_path.retry_s = 0.0  # (the link waits 10 s after a broken call; the story is the same)
        # The first calls after the restart may fail; the client asks the daemon again and carries on.
        hs = hashes(100, start=500)
        for _ in range(3):
            put(c, hs)
        assert c.lookup(hs) == 100 and intact(c, hs)
        assert second.data_path_server.calls >= 2 and c.hello.max_blocks == 64
    finally:
        c.close()
        for d in (first, second):
            if d is not None:
                d.stop(grace_s=0)


def test_a_connection_that_goes_quiet_lets_its_buffers_go(start):
    from cache_service.protocol import socket_server

    d = start()
    with GrpcClient(url(d, "stream")) as c:
        # A batch stored over the data path: its connection keeps the request-sized buffer for the next call.
        assert put(c, hashes(16)) == 16
        conns = [st for _, st in d.data_path_server._conns.values()]
        assert conns and any(st.arena.holding for st in conns)
        # Quiet a little longer than the server waits: no buffer is held by an idle connection.
        time.sleep(socket_server.ARENA_IDLE_S + 1.0)
        assert not any(st.arena.holding for st in conns)
        # The next call works as before.
        assert intact(c, hashes(16))


def test_connections_on_descriptors_past_1024_keep_serving(start):
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]  # a daemon with many files open
    try:
        d = start()
        with GrpcClient(url(d, "stream")) as c:
            # The connection's descriptor lies past 1024; its first call fills the buffer, the next waits for it.
            assert put(c, hashes(16)) == 16
            assert all(st.sock.fileno() >= 1024 for _, st in d.data_path_server._conns.values())
            calls = d.data_path_server.calls
            # Its second call is answered over the same path (select() refused such descriptors: a miss).
            assert intact(c, hashes(16)) and d.data_path_server.calls == calls + 1
    finally:
        for f in filler:
            os.close(f)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
