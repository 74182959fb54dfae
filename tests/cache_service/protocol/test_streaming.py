"""The streamed data path's hand-built messages (cache_service/protocol/streaming.py), without a server."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_service.protocol.streaming import (FramingError, LoadReader, ObjectReader, StoreMessage, admit, encode_pieces,
                                   load_messages, object_pieces, parse_load_chunk, store_messages)
from cache_service.blocks.objects import HEADER_SIZE, decode, encode
from cache_service.protocol.messages import ns_to_pb
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tiers.types import CorruptBlockError

P = NS.payload_bytes


def objects(hs) -> list[torch.Tensor]:
    return [encode(NS, h, payload_for(h)) for h in hs]


def load_stream(objs, hits, chunk: int) -> list[bytes]:
    """Serialized LoadChunks for blocks whose objects are `objs`, misses where `hits` is False."""
    return list(load_messages([[o.numpy()] if hit else None for o, hit in zip(objs, hits)], P, chunk))


def read_load(hs, raw: list[bytes]) -> LoadReader:
    reader = LoadReader(NS, hs)
    for msg in raw:
        reader.feed(*parse_load_chunk(msg))
    return reader


@pytest.mark.parametrize("chunk", [3 * OBJ, 2 * OBJ + 5, OBJ // 3])
def test_load_messages_are_load_chunks_of_whole_objects(chunk):
    hs = hashes(7)
    objs, hits = objects(hs), [True, False, True, True, False, True, True]
    raw = load_stream(objs, hits, chunk)
    # the generated parser reads them: sizes announce every block once, data concatenates the hits' objects
    parsed = [pb.LoadChunk.FromString(m) for m in raw]
    assert [s for m in parsed for s in m.sizes] == [P if hit else 0 for hit in hits]
    assert b"".join(m.data for m in parsed) == b"".join(o.numpy().tobytes() for o, hit in zip(objs, hits) if hit)
    # no message carries more than chunk data bytes; whole objects unless one is larger than a message
    assert all(len(m.data) <= chunk for m in parsed)
    if chunk >= OBJ:
        assert all(len(m.data) % OBJ == 0 for m in parsed)
    # the client gets verified payloads in request order, None for the misses
    out = read_load(hs, raw).result()
    assert [o is not None for o in out] == hits
    assert all(same(o, payload_for(h)) for o, h in zip(out, hs) if o is not None)
    assert out[0].shape == NS.block_shape and out[0].dtype == torch.bfloat16


def test_store_messages_are_store_chunks_of_whole_objects():
    hs = hashes(5)
    head = pb.StoreChunk(ns=ns_to_pb(NS), hashes=hs).SerializeToString()
    raw = list(store_messages(head, (encode_pieces(NS, h, payload_for(h)) for h in hs), OBJ, 2 * OBJ))
    parsed = [pb.StoreChunk.FromString(m) for m in raw]
    # ns and hashes lead the first message only; data is the objects, as `encode` makes them
    assert list(parsed[0].hashes) == hs and not any(m.HasField("ns") or m.hashes for m in parsed[1:])
    assert [len(m.data) for m in parsed] == [2 * OBJ, 2 * OBJ, OBJ]
    assert b"".join(m.data for m in parsed) == b"".join(o.numpy().tobytes() for o in objects(hs))
    # the daemon's reading of the same bytes: head fields parsed, data a view of the message
    got = [StoreMessage(m) for m in raw]
    assert not any(m.error for m in got) and list(got[0].head.hashes) == hs
    assert got[0].data.obj is raw[0]
    # a store of no blocks is the head alone
    assert list(store_messages(head, [], OBJ, 2 * OBJ)) == [head]


def test_whole_objects_are_read_in_place_and_cut_ones_reassembled():
    objs = objects(hashes(3))
    data = memoryview(b"".join(o.numpy().tobytes() for o in objs))
    reader = ObjectReader(OBJ)
    reader.expect(3)
    # the first object lies whole in the view: a view of it, no copy
    got = reader.feed(data[: OBJ + 10])
    assert len(got) == 1 and got[0] == objs[0].numpy().tobytes() and got[0].obj is data.obj
    # the second is cut across two views: reassembled in its own buffer
    got = reader.feed(data[OBJ + 10:])
    assert [g == o.numpy().tobytes() for g, o in zip(got, objs[1:])] == [True, True] and reader.idle
    assert got[0].obj is not data.obj and got[1].obj is data.obj
    assert reader.received == 3 * OBJ


def test_a_corrupt_streamed_block_is_a_miss_the_others_are_intact():
    hs = hashes(4)
    objs = objects(hs)
    objs[1][HEADER_SIZE + 7] ^= 0x01  # a payload bit flips on the way
    objs[2][30] ^= 0x01  # a header bit (the block hash) flips
    reader = read_load(hs, load_stream(objs, [True] * 4, 2 * OBJ))
    out = reader.result()
    assert [o is not None for o in out] == [True, False, False, True] and reader.corrupt == 2
    assert same(out[3], payload_for(hs[3]))


def test_an_object_for_another_block_is_a_miss():
    hs = hashes(2)
    objs = objects(hs[::-1])  # each object is valid, for the other block
    reader = read_load(hs, load_stream(objs, [True, True], 4 * OBJ))
    assert reader.result() == [None, None] and reader.corrupt == 2


@pytest.mark.parametrize("case, why", [
    ("more data than announced", "announced"),
    ("announced before the objects", "before"),
    ("ends early", "missing"),
    ("too many blocks", "announced after"),
    ("odd size", "announced after"),
])
def test_a_load_stream_breaking_the_rules_is_refused(case, why):
    hs = hashes(2)
    objs = objects(hs)
    whole = b"".join(o.numpy().tobytes() for o in objs)
    streams = {
        "more data than announced": [pb.LoadChunk(sizes=[P, 0], data=whole)],
        "announced before the objects": [pb.LoadChunk(sizes=[P], data=whole[:OBJ // 2]),
                                         pb.LoadChunk(sizes=[P], data=whole[OBJ // 2:])],
        "ends early": [pb.LoadChunk(sizes=[P, P], data=whole[:-1])],
        "too many blocks": [pb.LoadChunk(sizes=[0, 0, 0])],
        "odd size": [pb.LoadChunk(sizes=[P - 1, P])],
    }
    with pytest.raises(FramingError, match=why):
        read_load(hs, [m.SerializeToString() for m in streams[case]]).result()


def test_garbage_store_messages_are_reported_not_raised():
    # truncated length, a group wire type, a bad varint: each an error for the daemon to answer with
    for raw in (b"\x1a\x05abc", b"\x0b", b"\xff" * 11):
        msg = StoreMessage(raw)
        assert msg.error and len(msg.data) == 0
    # protobuf's own checks apply to the other fields
    assert StoreMessage(b"\x0a\x02\xff\xff").error  # ns: a malformed submessage


def test_admit_checks_in_full_and_reheads_for_the_store():
    hs = hashes(2)
    obj = encode(NS, hs[0], payload_for(hs[0]))
    sent = memoryview(obj.numpy().tobytes())  # as received: immutable message bytes
    # the client's own header: a tensor over the received bytes, not a copy
    assert admit(sent, NS, hs[0], NS, hs[0]).data_ptr() == np.frombuffer(sent, dtype=np.uint8).ctypes.data
    # a tenant's keys and namespace: a copy carrying the store's header, payload unchanged
    tenant_ns = NS.with_tenant("acme")
    moved = admit(sent, NS, hs[0], tenant_ns, hs[1])
    assert same(decode(moved, tenant_ns, hs[1]), payload_for(hs[0]))
    # any flipped bit is refused, with decode's diagnosis
    for at, why in ((HEADER_SIZE + 3, "payload checksum"), (30, "header checksum")):
        bad = bytearray(sent)
        bad[at] ^= 0x10
        with pytest.raises(CorruptBlockError, match=why):
            admit(memoryview(bad), NS, hs[0], NS, hs[0])
    # a header whose padding is set is refused too (decode says so)
    bad = bytearray(sent)
    bad[100] = 1
    with pytest.raises(CorruptBlockError, match="padding"):
        admit(memoryview(bad), NS, hs[0], NS, hs[0])


def test_loaded_objects_are_reheaded_for_the_client():
    hs = hashes(2)
    tenant_ns = NS.with_tenant("acme")
    stored = encode(tenant_ns, hs[1], payload_for(hs[0]))  # as the store holds it: tenant namespace and key
    view = memoryview(stored.numpy())
    pieces = object_pieces(view, tenant_ns, hs[1], NS, hs[0])
    sent = torch.frombuffer(bytearray(b"".join(bytes(p) for p in pieces)), dtype=torch.uint8)
    assert same(decode(sent, NS, hs[0]), payload_for(hs[0]))
    # without a tenant the stored object goes as it is, not copied
    assert object_pieces(view, tenant_ns, hs[1], tenant_ns, hs[1]) == [view]
    # a stored object whose header is not canonical for its key is not sent
    assert object_pieces(view, tenant_ns, hs[0], NS, hs[0]) is None
