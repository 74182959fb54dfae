"""The daemon's shared-memory paths: objects encoded by the client in place,
checked by the daemon; loads handed out as views of the segment."""
from __future__ import annotations

import os
import time

import grpc
import pytest
import torch

from cache_service.blocks.objects import HEADER_SIZE, encode_into, object_size
from cache_service.protocol.segment import Segment
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, hashes, payload_for, same
from tests.cache_service.server.test_servicer import code_of, intact, put, raw, start, url  # noqa: F401 (fixture)

S = object_size(NS)


def attached(stub, hs) -> tuple[Segment, str]:
    """A segment of room for 4 objects, attached to the daemon, holding the objects of `hs` back to back."""
    seg = Segment(4 * S)
    try:
        aid = stub.Attach(pb.AttachRequest(name=seg.name, nonce=seg.nonce)).attachment
    except BaseException:
        seg.close()
        raise
    for i, h in enumerate(hs):
        encode_into(seg.data[i * S: (i + 1) * S], NS, h, payload_for(h))
    return seg, aid


def test_store_shm_refuses_objects_that_do_not_match_what_was_sent(start):
    d = start()
    stub, hs = raw(d), hashes(3)
    seg, aid = attached(stub, hs)
    try:
        req = pb.ShmRequest(ns=ns_to_pb(NS), hashes=hs, attachment=aid)
        # a payload byte changed after encoding: refused, nothing stored
        seg.data[2 * S + HEADER_SIZE + 5] ^= 1
        code, why = code_of(lambda: stub.StoreShm(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "checksum mismatch" in why
        # and stays refused when sent again (the daemon left the client's header as it was)
        assert "checksum mismatch" in code_of(lambda: stub.StoreShm(req))[1]
        # an object encoded for another block: refused too
        seg.data[2 * S + HEADER_SIZE + 5] ^= 1
        encode_into(seg.data[S: 2 * S], NS, hs[0], payload_for(hs[0]))
        assert "expected" in code_of(lambda: stub.StoreShm(req))[1]
        with GrpcClient(url(d, "stream")) as c:
            assert c.lookup(hs) == 0
        # put right, the batch is stored and reads back intact over either path
        encode_into(seg.data[S: 2 * S], NS, hs[1], payload_for(hs[1]))
        assert stub.StoreShm(req).stored == 3
        for t in ("stream", "shm"):
            with GrpcClient(url(d, t)) as c:
                assert intact(c, hs)
    finally:
        seg.close()


def test_loaded_blocks_stay_intact_while_the_caller_holds_them(start):
    d = start()
    with GrpcClient(url(d, "shm"), shm_bytes=8 * S) as c:
        a, b = hashes(4), hashes(4, start=500)
        assert put(c, a) == 4 and put(c, b) == 4
        # the first load's payloads are held while more loads and stores use the segment
        held = c.load(NS, a)
        for _ in range(3):
            assert intact(c, b)
            assert put(c, hashes(2, start=900 + _ * 10)) == 2
        assert all(same(p, payload_for(h)) for p, h in zip(held, a))
        # dropped, their room is reused by the next load
        del held
        assert intact(c, a) and c.transport == "shm"


def test_a_caller_holding_the_whole_segment_still_gets_answers(start):
    d = start()
    with GrpcClient(url(d, "shm"), shm_bytes=4 * S) as c:
        hs = hashes(4)
        assert put(c, hs) == 4
        # a load filling the segment is held; the next load and store find no room and stream instead
        held = c.load(NS, hs)
        assert intact(c, hs) and put(c, hashes(2, start=700)) == 2
        assert all(same(p, payload_for(h)) for p, h in zip(held, hs))
        assert isinstance(held[0], torch.Tensor) and c.transport == "shm"


def test_a_segment_cut_short_under_the_daemon_is_refused_not_a_crash(start):
    d = start()
    stub, hs = raw(d), hashes(2)
    seg, aid = attached(stub, hs)
    try:
        # The client cuts its segment's file short: touching those pages would kill the daemon (SIGBUS).
        os.truncate(seg.path, 4096)
        req = pb.ShmRequest(ns=ns_to_pb(NS), hashes=hs, attachment=aid)
        code, why = code_of(lambda: stub.StoreShm(req))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "cut short" in why
        assert code_of(lambda: stub.LoadShm(req))[0] == grpc.StatusCode.FAILED_PRECONDITION
        # The daemon lives on and serves the others.
        with GrpcClient(url(d, "stream")) as c:
            assert c.store(NS, hs, [payload_for(h) for h in hs]) == 2 and c.lookup(hs) == 2
    finally:
        seg.close()


def test_the_pool_a_client_maps_cannot_be_cut_short(start):
    d = start(cpu_blocks=16, shared=True)
    with GrpcClient(url(d, "shm")) as c:
        c.store(NS, hashes(1), [payload_for(hashes(1)[0])])
    # A client holds the daemon's pool's descriptor (MAP_POOL): the pool is sealed at its size.
    fd = os.dup(d.store.tiers[0].share_fd)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def test_payloads_loaded_in_place_survive_the_client_dropping_its_connection(start):
    d = start(cpu_blocks=16, shared=True)
    a, others = hashes(4), hashes(32, start=1000)
    with GrpcClient(url(d, "shm")) as c1, GrpcClient(url(d, "stream")) as c2:
        # c1 loads views of blocks where they lie in the daemon's pool; they are evicted from it since.
        c1.store(NS, a, [payload_for(h) for h in a])
        held = c1.load(NS, a)
        assert c1._near.pool is not None and all(same(p, payload_for(h)) for p, h in zip(held, a))
        c2.store(NS, others, [payload_for(h) for h in others])
        # c1's attachment is reaped (idle), so its next load fails and it drops its connection.
        d.attachments.idle_s = 0.0
        time.sleep(0.05)
        d.attachments.reap()
        d.attachments.idle_s = 600
        c1.load(NS, hashes(1, start=5000))
        # Another client fills the pool again: the views c1's caller still holds are left as they were.
        c2.store(NS, hashes(32, start=2000), [payload_for(h) for h in hashes(32, start=2000)])
        assert all(same(p, payload_for(h)) for p, h in zip(held, a))
        # Once the caller drops them, the old connection goes.
        del held
        c1.load(NS, a[:1])
        assert c1._near._retired == []


def test_a_client_that_drops_its_segment_detaches_it(start):
    d = start(cpu_blocks=16)
    hs = hashes(2)
    with GrpcClient(url(d, "shm")) as c:
        c.store(NS, hs, [payload_for(h) for h in hs])
        # Each failed shared-memory call drops the client's segment; the next one attaches a new one.
        for _ in range(8):
            c._near.drop()
            assert intact(c, hs)
        # The daemon holds the one in use, not one per drop (64 and no client on the host could attach).
        deadline = time.monotonic() + 10
        while d.attachments.counts()[0] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.attachments.counts()[0] == 1


def test_objects_the_client_writes_again_after_the_check_are_not_what_is_stored(start, monkeypatch):
    import cache_service.server.servicer as servicer

    d = start()
    stub, hs = raw(d), hashes(3)
    seg, aid = attached(stub, hs)
    real = servicer.adopt

    def then_written(*args, **kw):  # the client writes its segment again right after the daemon's check
        got = real(*args, **kw)
        seg.data[HEADER_SIZE: S].fill_(0x3c)
        return got
    monkeypatch.setattr(servicer, "adopt", then_written)
    try:
        # the batch is stored as it was when checked, in the top tier and on disk
        assert stub.StoreShm(pb.ShmRequest(ns=ns_to_pb(NS), hashes=hs, attachment=aid)).stored == 3
        d.store.flush(60)
        with GrpcClient(url(d, "stream")) as c:
            assert intact(c, hs)
        d.store.tiers[0].delete_many(hs)
        with GrpcClient(url(d, "stream")) as c:
            assert intact(c, hs)
    finally:
        seg.close()
