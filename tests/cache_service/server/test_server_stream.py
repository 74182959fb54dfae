"""The streamed data path end to end: a real daemon in-process, raw stubs and `GrpcClient`."""
from __future__ import annotations

import grpc
import pytest

from cache_service.blocks.objects import HEADER_SIZE, encode
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tests.cache_service.server.test_servicer import TOKENS, code_of, intact, put, raw, start, url  # noqa: F401, F811 (start: a fixture)

Code = grpc.StatusCode


def objects_bytes(hs, flip: int | None = None) -> bytes:
    """The blocks' objects back to back, as a client streams them; `flip` flips one byte."""
    data = bytearray(b"".join(encode(NS, h, payload_for(h)).numpy().tobytes() for h in hs))
    if flip is not None:
        data[flip] ^= 0x01
    return bytes(data)


@pytest.mark.parametrize("chunk", [OBJ // 3, 2 * OBJ + 1, 1 << 20])
def test_stream_round_trip_with_objects_whole_or_cut(start, chunk):
    # messages of a third of an object, two objects, or many: every framing case
    d = start(cpu_blocks=64, chunk_bytes=chunk)
    with GrpcClient(url(d, "stream")) as c:
        hs = hashes(12)
        assert put(c, hs[:10]) == 10
        out = c.load(NS, hs)
        assert intact(c, hs[:10]) and out[10:] == [None, None]
        # what the daemon holds is what `encode` makes: its own checks pass
        assert all(p is not None for p in d.store.load(NS, hs[:10]))


def test_a_store_with_a_bad_object_is_refused_and_stores_nothing(start):
    d = start()
    stub, ns, hs = raw(d), ns_to_pb(NS), hashes(3)
    cases = [
        (HEADER_SIZE + OBJ + 5, "payload checksum"),  # a payload bit of block 1
        (OBJ + 30, "header checksum"),  # a header bit of block 1
    ]
    for flip, why in cases:
        code, msg = code_of(lambda: stub.Store(iter([pb.StoreChunk(ns=ns, hashes=hs, data=objects_bytes(hs, flip))])))
        assert code == Code.INVALID_ARGUMENT and "block 1" in msg and why in msg, msg
    # objects of other blocks (valid, but not for these hashes) are refused as well
    code, msg = code_of(lambda: stub.Store(iter([pb.StoreChunk(ns=ns, hashes=hs, data=objects_bytes(hs[::-1]))])))
    assert code == Code.INVALID_ARGUMENT and "block 0" in msg
    # bytes that are no StoreChunk at all: a clear refusal, not an internal error
    store = grpc.insecure_channel(d.address).stream_unary("/tierkv.v1.TierKV/Store")
    code, msg = code_of(lambda: store(iter([b"\x1a\xff\xff\xff\x0f"])))
    assert code == Code.INVALID_ARGUMENT and "malformed" in msg
    assert d.store.lookup(hs) == 0
    # the same blocks, sent right, are stored
    assert stub.Store(iter([pb.StoreChunk(ns=ns, hashes=hs, data=objects_bytes(hs))])).stored == 3


def test_a_block_corrupted_in_the_daemon_is_a_streamed_miss(start):
    d = start(disk=False)
    with GrpcClient(url(d, "stream")) as c:
        hs = hashes(3)
        put(c, hs)
        # a payload bit flips in the daemon's memory (its CPU tier does not check payloads on reads)
        pool = d.store.tiers[0]
        pool._pool[pool._index[hs[1]][0], HEADER_SIZE + 11] ^= 0x04
        # the client checks every streamed object: that block is a miss, the others arrive intact
        out = c.load(NS, hs)
        assert out[1] is None and same(out[0], payload_for(hs[0])) and same(out[2], payload_for(hs[2]))
        assert c.errors == 0


def test_tenants_stream_under_their_own_keys(start):
    d = start(auth=True)
    hs = hashes(4)
    with GrpcClient(url(d, "stream"), token=TOKENS["acme"]) as acme, \
            GrpcClient(url(d, "stream"), token=TOKENS["globex"]) as globex:
        # objects are re-headed for the tenant's namespace and keys on the way in, and back on the way out
        assert put(acme, hs) == 4 and intact(acme, hs)
        assert globex.load(NS, hs) == [None] * 4
        assert acme.stats()["cpu"]["corrupt"] == 0
