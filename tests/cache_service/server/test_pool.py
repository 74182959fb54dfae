"""The shared-pool store: a same-host client reserves slots of the daemon's
host pool, encodes block objects straight into them, and the daemon checks
and publishes them (cache_service/server/pool.py, cache_service/store/shared_slots.py)."""
from __future__ import annotations

import mmap
import os
import time

import grpc
import pytest
import torch

from cache_service.protocol.ops import Op
from cache_service.protocol.socket_client import SocketCallError, SocketClient
from cache_service.config import load_config
from cache_service.server.daemon import share_cpu_pool
from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.blocks.objects import HEADER_SIZE, encode_objects, object_size
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from cache_service.protocol.batches import split
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, hashes, payload_for, same
from tests.cache_service.server.test_servicer import TOKENS, intact, put, start, url  # noqa: F401 (fixture)

Code = grpc.StatusCode
S = object_size(NS)


def _free_slots(d) -> int:
    return d.store.tiers[0].free_bytes() // d.store.tiers[0].slot_bytes


def _reserve(sock: SocketClient, hs) -> list[int]:
    return list(sock.call(Op.RESERVE, pb.BlocksRequest(ns=ns_to_pb(NS), hashes=hs)).slots)


def _commit(sock: SocketClient, hs, slots):
    return sock.call(Op.COMMIT, pb.CommitRequest(ns=ns_to_pb(NS), hashes=hs, slots=slots))


def _map(sock: SocketClient):
    reply, fd = sock.call_fd(Op.MAP_POOL, pb.PoolRequest(ns=ns_to_pb(NS)))
    try:
        mm = mmap.mmap(fd, reply.num_slots * reply.slot_stride, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8).view(reply.num_slots, reply.slot_stride)[:, :reply.slot_bytes]


def test_a_same_host_client_stores_straight_into_the_daemons_pool(start):
    d = start(shared=True)
    with GrpcClient(url(d, "shm")) as c:
        # the first store maps the daemon's pool (its memfd came over the same-host socket) and lands in it
        hs = hashes(40)
        assert put(c, hs) == 40 and c._near.pool is not None
        assert d.store.stats()["cpu"]["blocks"] == 40
        # the blocks read back intact, through the verified load path
        assert intact(c, hs)
        # storing them again stores nothing and keeps no slot: they are held
        free = _free_slots(d) + len(c._near.spare)
        assert put(c, hs) == 0 and _free_slots(d) + len(c._near.spare) == free
        # and they reach the disk tier below like any other block
        assert d.store.flush(60) and d.store.tiers[1].contains_many(hs) == [True] * 40


def test_a_commit_leaves_spare_slots_the_next_store_starts_in(start):
    d = start(shared=True)  # 64 slots: a client may hold 4 spares
    with GrpcClient(url(d, "shm")) as c:
        # the first store reserves, then its Commit also leases four spare slots
        assert put(c, hashes(2)) == 2
        assert len(c._near.spare) == 4 and _free_slots(d) == 64 - 2 - 4
        # the next store fills spares at once: one same-host socket call (its Commit) instead of two
        calls = d.same_host_server.calls
        assert put(c, hashes(3, start=10)) == 3 and d.same_host_server.calls == calls + 1
        assert intact(c, hashes(3, start=10))
        # and its Commit tops the spares up to four again, no more
        assert len(c._near.spare) == 4 and _free_slots(d) == 64 - 5 - 4
    # spares never used go back when the connection ends
    deadline = time.monotonic() + 10
    while _free_slots(d) != 64 - 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _free_slots(d) == 64 - 5


def test_reserved_slots_go_back_when_their_connection_ends(start):
    d = start(shared=True)
    free = _free_slots(d)
    sock = SocketClient(d.same_host_server.path, None, 10.0)
    # a client reserves four slots and dies before committing
    _map(sock)
    slots = _reserve(sock, hashes(4))
    assert all(s >= 0 for s in slots) and _free_slots(d) == free - 4
    sock.close()
    # the daemon hands them back; nothing was published
    deadline = time.monotonic() + 10
    while _free_slots(d) != free and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _free_slots(d) == free
    with GrpcClient(url(d, "stream")) as c:
        assert c.lookup(hashes(4)) == 0


def test_a_connection_holds_at_most_a_requests_worth_of_slots(start):
    d = start(shared=True, max_request_bytes=4 * NS.payload_bytes)
    sock = SocketClient(d.same_host_server.path, None, 10.0)
    try:
        # four slots reserved and not committed: a fifth is refused until they are
        rows = _map(sock)
        hs = hashes(5)
        slots = _reserve(sock, hs[:4])
        with pytest.raises(SocketCallError) as e:
            _reserve(sock, hs[4:])
        assert e.value.code() == Code.RESOURCE_EXHAUSTED
        encode_objects(rows, slots, NS, hs[:4], [payload_for(h) for h in hs[:4]])
        assert _commit(sock, hs[:4], slots).stored == 4 and min(_reserve(sock, hs[4:])) >= 0
    finally:
        sock.close()


def test_commit_takes_only_the_slots_its_connection_reserved_for_those_blocks(start):
    d = start(shared=True)
    a, b = SocketClient(d.same_host_server.path, None, 10.0), SocketClient(d.same_host_server.path, None, 10.0)
    try:
        rows = _map(a)
        hs = hashes(3)
        slots = _reserve(a, hs)
        encode_objects(rows, slots, NS, hs, [payload_for(h) for h in hs])
        # another connection cannot commit them
        with pytest.raises(SocketCallError) as e:
            _commit(b, hs, slots)
        assert e.value.code() == Code.INVALID_ARGUMENT and "reserved" in e.value.details()
        # nor can their owner under other hashes, or one slot twice
        for bad_hs, bad_slots in ((hashes(3, start=50), slots), (hs[:2], [slots[0], slots[0]])):
            with pytest.raises(SocketCallError) as e:
                _commit(a, bad_hs, bad_slots)
            assert e.value.code() == Code.INVALID_ARGUMENT
        # slots never written: refused too (their headers are not theirs)
        other = _reserve(a, hashes(2, start=70))
        with pytest.raises(SocketCallError) as e:
            _commit(a, hashes(2, start=70), other)
        assert e.value.code() == Code.INVALID_ARGUMENT and "bad block object" in e.value.details()
        # a refused commit took nothing from the lease: the right one still works
        assert _commit(a, hs, slots).stored == 3
        with GrpcClient(url(d, "stream")) as c:
            assert intact(c, hs)
    finally:
        a.close()
        b.close()


def test_a_payload_scribbled_after_its_commit_is_a_miss_not_a_wrong_answer(start):
    d = start(shared=True, disk=False)
    with GrpcClient(url(d, "shm")) as c:
        hs = hashes(4)
        assert put(c, hs) == 4
        # a byte of block 2's payload changes in the pool after its commit
        slot = d.store.tiers[0]._index[hs[2]][0]
        c._near.pool.rows[slot, HEADER_SIZE + 7] ^= 0xFF
        # loads verify the shared pool: block 2 is a miss (and quarantined), the others are intact
        got = c.load(NS, hs)
        assert got[2] is None and intact(c, hs[:2]) and intact(c, hs[3:])
        assert d.store.stats()["cpu"]["corrupt"] == 1 and c.lookup(hs) == 2


def test_the_pool_is_shared_with_one_tenant_only(start):
    # two tenants: the pool is not offered, stores go through the client's segment
    d = start(shared=True, auth=True)
    with GrpcClient(url(d, "shm"), token=TOKENS["acme"]) as c:
        assert put(c, hashes(3)) == 3 and intact(c, hashes(3))
        assert c._near.pool is None and c._near.pool_refused
    # one tenant: offered, and the daemon heads the blocks with that tenant's keys
    d = start(shared=True, tokens={"acme": TOKENS["acme"]})
    with GrpcClient(url(d, "shm"), token=TOKENS["acme"]) as c:
        assert put(c, hashes(3)) == 3 and c._near.pool is not None
        assert intact(c, hashes(3)) and d.store.tiers[0].contains_many(hashes(3)) == [False] * 3


def test_blocks_the_pool_has_no_room_for_go_the_usual_way(start):
    d = start(shared=True, cpu_blocks=4)
    with GrpcClient(url(d, "shm")) as c:
        # the pool is full of pinned blocks
        pinned = hashes(4, start=300)
        assert put(c, pinned) == 4
        c.pin(pinned, ns=NS)
        # new blocks get no slot; the daemon places them below, and they read back
        hs = hashes(3)
        assert put(c, hs) == 0 and c._near.pool is not None
        assert d.store.flush(60) and intact(c, hs) and intact(c, pinned)


def test_a_store_is_cut_in_chunks_with_short_first_and_last_ones():
    # every position once, in order; the chunks at both ends a quarter of the others
    for n, per in ((91, 22), (1, 22), (10, 22), (16, 4), (100, 1)):
        chunks = split(n, per, edge=per // 4)
        assert sum((list(c) for c in chunks), []) == list(range(n))
        assert max(len(c) for c in chunks) <= per
    assert [len(c) for c in split(91, 22, edge=22 // 4)] == [5, 22, 22, 22, 15, 5]


def test_blocks_larger_than_the_pools_slots_go_through_the_segment(start):
    d = start(shared=True)  # slots sized for NS
    big = Namespace("test-model", "bfloat16", num_layers=4, kv_heads=2, head_dim=16, block_tokens=4)
    hs = prefix_hashes(big, range(12))
    with GrpcClient(url(d, "shm")) as c:
        # the pool is mapped but cannot take them: the segment carries them, the daemon places them below
        assert c.store(big, hs, [torch.ones(big.block_shape, dtype=torch.bfloat16)] * 3) == 0
        assert c.errors == 0 and d.store.flush(60) and c.lookup(hs) == 3
        # a Commit naming them in NS's slots is refused, and hands the slots back
        sock = c._near.socket
        free = _free_slots(d)
        slots = _reserve(sock, hashes(2))
        with pytest.raises(SocketCallError) as e:
            sock.call(Op.COMMIT, pb.CommitRequest(ns=ns_to_pb(big), hashes=hashes(2), slots=slots))
        assert e.value.code() == Code.INVALID_ARGUMENT and _free_slots(d) == free


def test_a_daemon_that_does_not_share_its_pool_refuses_the_pool_calls(start):
    d = start()
    sock = SocketClient(d.same_host_server.path, None, 10.0)
    try:
        for op, request in ((Op.RESERVE, pb.BlocksRequest(ns=ns_to_pb(NS), hashes=hashes(1))),
                              (Op.COMMIT, pb.CommitRequest(ns=ns_to_pb(NS), spare=3))):
            with pytest.raises(SocketCallError) as e:
                sock.call(op, request)
            assert e.value.code() == Code.FAILED_PRECONDITION
    finally:
        sock.close()


def test_spare_slots_are_bounded_per_client_and_over_all_clients(start):
    d = start(shared=True)  # 64 slots: 4 spares per client, 8 in all
    clients = [GrpcClient(url(d, "shm")) for _ in range(3)]
    try:
        for i, c in enumerate(clients):
            assert put(c, hashes(2, start=100 * i)) == 2
        assert [len(c._near.spare) for c in clients] == [4, 4, 0]
        assert d.store._state.spares_out == 8
    finally:
        for c in clients:
            c.close()


def test_partly_spare_first_chunks_stay_within_the_reserve_limit(start):
    d = start(shared=True, cpu_blocks=256, max_request_bytes=40 * NS.payload_bytes)
    with GrpcClient(url(d, "shm")) as c:
        # a store leaves spares; the next one, a whole request's worth, uses them and reserves the rest
        assert put(c, hashes(1)) == 1 and c._near.spare
        hs = hashes(40, start=500)
        assert put(c, hs) == 40 and c.errors == 0 and intact(c, hs)


def test_tierkv_serve_shares_its_cpu_pool_only_when_it_is_the_top_tier():
    # auto: yes for a CPU top tier; no under an HBM tier, or when pinned; an explicit choice stays
    cases = [({}, "yes"), ({"hbm": {"capacity": 1 << 20, "device": "cpu"}}, "no"), ({"cpu": {"pin": "yes"}}, "no"),
             ({"cpu": {"shared": "no"}}, "no")]
    for tiers, want in cases:
        cfg = load_config(env={}, overrides={"tiers": {**tiers, "cpu": {"capacity": 1 << 20} | tiers.get("cpu", {})}})
        share_cpu_pool(cfg)
        assert cfg.tiers.cpu.shared == want, tiers


def test_loads_read_the_pool_in_place_and_hand_slots_back_once_dropped(start):
    d = start(shared=True)
    with GrpcClient(url(d, "shm")) as c:
        hs = hashes(8)
        assert put(c, hs) == 8
        # a load: the daemon holds the blocks' slots and the payloads are views of its pool
        got = c.load(NS, hs)
        assert all(same(g, payload_for(h)) for g, h in zip(got, hs))
        assert all(g.untyped_storage().data_ptr() == c._near.pool.rows.untyped_storage().data_ptr() for g in got)
        # the blocks go away in the daemon, but their slots stay held: not free, bytes unchanged
        free = _free_slots(d)
        d.store.delete(hs)
        assert _free_slots(d) == free and all(same(g, payload_for(h)) for g, h in zip(got, hs))
        # once the payloads are dropped, the next call hands the slots back
        del got
        assert c.load(NS, hashes(1, start=99)) == [None]
        assert _free_slots(d) == free + 8


def test_a_scribbled_pool_slot_is_a_miss_never_a_wrong_block(start):
    d = start(shared=True)
    with GrpcClient(url(d, "shm")) as c:
        hs = hashes(4)
        assert put(c, hs) == 4 and d.store.flush(60)  # on disk too (write-through)
        # someone with the pool mapped flips a payload bit of the third block
        sock = SocketClient(d.same_host_server.path, None, 10.0)
        slots = list(sock.call(Op.HOLD, pb.BlocksRequest(ns=ns_to_pb(NS), hashes=hs)).slots)
        sock.call(Op.LET_GO, pb.LetGoRequest(slots=slots))
        c._near.pool.rows[slots[2], HEADER_SIZE + 7] ^= 1
        # the client's check refuses it in place; the segment path asks again, and the daemon quarantines
        # the pool's copy and serves the sound one its disk tier has: every block right
        got = c.load(NS, hs)
        assert all(same(g, payload_for(h)) for g, h in zip(got, hs))
        assert d.store.stats()["cpu"]["corrupt"] == 1
        # a slot not held by this connection cannot be let go
        with pytest.raises(SocketCallError) as e:
            sock.call(Op.LET_GO, pb.LetGoRequest(slots=[slots[0]]))
        assert e.value.code() == Code.INVALID_ARGUMENT
        sock.close()
