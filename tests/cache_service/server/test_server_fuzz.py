"""Fuzzing a live daemon: hypothesis-generated requests, mostly malformed,
through gRPC, the same-host socket and the data path; every one is answered with a
client-error status at worst, and the blocks stored before stay intact."""
from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.server.daemon import Daemon
from cache_service.protocol.ops import BY_METHOD, Op
from cache_service.protocol.socket_client import SocketClient
from cache_service.config import ServerConfig
from cache_service.protocol.segment import Segment
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, hashes, make_store
from tests.cache_service.server.test_servicer import P, intact, put, raw, url

Code = grpc.StatusCode
ANSWERS = {Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.PERMISSION_DENIED, Code.NOT_FOUND,
           Code.FAILED_PRECONDITION}
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_dim = st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1))


def _mostly(good, bad, good_in_4: int = 3):
    """`good` in good_in_4 of 4 draws, else `bad` (one_of alone leans to the richer branch)."""
    return st.integers(0, 3).flatmap(lambda i: good if i < good_in_4 else bad)


_namespaces = _mostly(
    st.sampled_from([ns_to_pb(NS), ns_to_pb(NS.with_tenant("acme"))]),
    st.builds(pb.Namespace, model_id=_text, kv_dtype=st.sampled_from(["bfloat16", "int8", "float64", ""]),
              num_layers=_dim, kv_heads=_dim, head_dim=_dim, block_tokens=_dim, tp_rank=st.integers(0, 3),
              tp_world=st.integers(0, 3), codec=st.sampled_from(["", "raw", "zstd"]),
              tenant_salt=st.sampled_from(["", "acme", "a/b"])))
_maybe_ns = _mostly(_namespaces, st.none())
_hashes = _mostly(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=6),
                  st.lists(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=24)), max_size=4), 2)
_data = st.lists(st.one_of(st.binary(max_size=64), st.sampled_from([bytes(P), bytes(2 * P), bytes(P // 2)])),
                 max_size=4)
_session = st.builds(pb.Session, session_id=st.one_of(st.sampled_from(["s1", "s2"]), _text), tenant=_text,
                     messages_json=st.one_of(st.just("[]"), _text, st.just("[" * 100_000 + "]" * 100_000)),
                     namespace=st.one_of(st.sampled_from(["", "00", "zz", NS.fingerprint().hex()]), _text),
                     token_ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20))


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    d = Daemon(make_store(root / "store", cpu_blocks=32, shared=True), ServerConfig(
        listen="127.0.0.1:0", sessions_dir=str(root), max_blocks=8, max_request_bytes=8 * P)).start()
    seg = Segment(8 * P)
    stub = raw(d)
    aid = stub.Attach(pb.AttachRequest(name=seg.name, nonce=seg.nonce)).attachment
    client = GrpcClient(url(d, "stream"))
    put(client, hashes(6))
    sock = SocketClient(d.same_host_server.path, None, 10.0)
    yield client, stub, aid, sock, d.servicer.data_port
    sock.close()
    client.close()
    seg.close()
    d.stop(grace_s=0)


def _store_stream(ns, hs, data, resend_hashes):
    """A Store request stream; later messages may wrongly repeat hashes."""
    first = pb.StoreChunk(ns=ns, hashes=hs, data=data[0] if data else b"")
    return [first] + [pb.StoreChunk(data=x, hashes=hs[:resend_hashes]) for x in data[1:]]


def _requests(aid: str):
    """(method, request) pairs, mostly malformed, for every kind of RPC."""
    shm = st.builds(pb.ShmRequest, ns=_namespaces, hashes=_hashes, attachment=st.sampled_from([aid, aid, "", "bogus"]),
                    offset=_mostly(st.integers(0, 2 * P), st.integers(0, 2**40)))
    return st.one_of(
        st.tuples(st.just("Lookup"), st.builds(pb.LookupRequest, ns=_maybe_ns, hashes=_hashes)),
        st.tuples(st.sampled_from(["Load", "data_path:Load"]), st.builds(pb.LoadRequest, ns=_maybe_ns, hashes=_hashes)),
        st.tuples(st.just("Store"), st.builds(_store_stream, _maybe_ns, _hashes, _data, st.integers(0, 1))),
        st.tuples(st.sampled_from(["LoadShm", "StoreShm", "sock:LoadShm", "sock:StoreShm"]), shm),
        # the shared pool's calls (same-host socket only): slots from the pool, past it, negative, repeated
        st.tuples(st.just("sock:MapPool"), st.builds(pb.PoolRequest, ns=_namespaces)),
        st.tuples(st.just("sock:Reserve"), st.builds(pb.BlocksRequest, ns=_maybe_ns, hashes=_hashes)),
        st.tuples(st.just("sock:Commit"), st.builds(pb.CommitRequest, ns=_maybe_ns, hashes=_hashes, slots=st.lists(
            _mostly(st.integers(-3, 40), st.integers(-(2**63), 2**63 - 1)), max_size=6),
            spare=_mostly(st.integers(0, 4), st.integers(0, 2**32 - 1)))),
        st.tuples(st.just("Pin"), st.builds(pb.PinRequest, ns=_maybe_ns, hashes=_hashes, ttl_s=st.floats())),
        st.tuples(st.just("SaveSession"), st.builds(pb.SaveSessionRequest, session=_session, ns=_maybe_ns,
                                                    pin=st.booleans())),
        st.tuples(st.just("ResumeSession"), st.builds(pb.ResumeSessionRequest, session_id=_text, ns=_maybe_ns,
                                                      tenant=st.sampled_from(["", "acme", "../x"]))),
        st.tuples(st.just("Attach"), st.builds(pb.AttachRequest, name=st.one_of(_text, st.just("tierkv-none")),
                                               nonce=st.binary(max_size=20))),
    )


def _send(stub, sock, data_port: int, method: str, request):
    if method == "data_path:Load":  # the data path, on a connection of its own (the objects after the reply are left)
        data_path = SocketClient(("127.0.0.1", data_port), None, 10.0)
        try:
            return data_path.ask(Op.LOAD, request.SerializeToString())
        finally:
            data_path.close()
    if method == "sock:MapPool":  # answered with the pool's descriptor
        os.close(sock.call_fd(Op.MAP_POOL, request)[1])
        return None
    if method.startswith("sock:"):  # the same call rung on the same-host socket
        name = method.split(":")[1]
        return sock.call(BY_METHOD[name], request)
    rpc = getattr(stub, method)
    if method == "Load":
        return list(rpc(request))
    return rpc(iter(request)) if method == "Store" else rpc(request)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_requests_never_crash_the_daemon_or_lose_blocks(fuzz_target, data):
    client, stub, aid, sock, data_port = fuzz_target
    method, request = data.draw(_requests(aid))
    # any request gets an answer or a client-error status, never INTERNAL/UNKNOWN, on gRPC, the same-host socket or the data path
    try:
        _send(stub, sock, data_port, method, request)
    except grpc.RpcError as e:
        assert e.code() in ANSWERS, (method, e.code(), e.details())
    # and the blocks stored before are still there, intact
    assert intact(client, hashes(6))
