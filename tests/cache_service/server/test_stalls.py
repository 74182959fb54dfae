"""Streams that stall: a Store whose client sends nothing more, a Load whose
client stops reading. With the daemon's workers all held by such calls, every
other client hung; each is now cancelled after `stream_idle_s` and the
daemon answers the others."""
from __future__ import annotations

import threading

import grpc
import torch

from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.config import ServerConfig, load_config
from cache_service.factory import open_store
from cache_service.protocol.messages import ns_to_pb
from cache_service.server.daemon import Daemon
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.server.test_servicer import raw, start, url  # noqa: F401 (start: a fixture)
from tests.cache_service.store.store_helpers import NS, hashes

Code = grpc.StatusCode


def silent_store(d: Daemon, opened: threading.Event, hold: threading.Event):
    """A Store stream that sends its first message and then nothing until `hold` is set; its final status code."""
    def messages():
        yield pb.StoreChunk(ns=ns_to_pb(NS), hashes=hashes(2), data=b"")
        opened.set()
        hold.wait(30)

    try:
        raw(d).Store(messages(), timeout=30)
        return Code.OK
    except grpc.RpcError as e:
        return e.code()


def test_store_streams_that_go_silent_are_cancelled_and_others_are_served(start):
    d = start(workers=2, stream_idle_s=1.0)
    hold, codes = threading.Event(), []
    # Two clients open Store streams and go silent: both of the daemon's workers are theirs.
    stalled = []
    for _ in range(2):
        opened = threading.Event()
        stalled.append(threading.Thread(target=lambda o=opened: codes.append(silent_store(d, o, hold))))
        stalled[-1].start()
        assert opened.wait(10)
    # A third client is still answered (its deadline is far past the idle limit, far short of the stalls' own).
    lookup = raw(d).Lookup(pb.BlocksRequest(hashes=hashes(2)), timeout=15)
    assert lookup.blocks == 0
    for t in stalled:
        t.join(20)
    hold.set()
    # The silent ones were cancelled, and counted.
    assert codes == [Code.CANCELLED, Code.CANCELLED] and d.servicer.stalls.cancelled == 2


BIG = Namespace("stall-model", "bfloat16", num_layers=8, kv_heads=8, head_dim=128, block_tokens=16)  # 512 KiB blocks


def test_a_load_whose_client_stops_reading_is_cancelled(tmp_path):
    tiers = {"cpu": {"capacity": 64 << 20}}
    store = open_store(load_config(env={}, overrides={"tiers": tiers}))
    d = Daemon(store, ServerConfig(listen="127.0.0.1:0", workers=1, stream_idle_s=1.0,
                                   sessions_dir=str(tmp_path / "sessions"))).start()
    try:
        hs = prefix_hashes(BIG, range(48 * 16))
        with GrpcClient(url(d, "stream")) as c:
            assert c.store(BIG, hs, [torch.ones(BIG.block_shape, dtype=torch.bfloat16)] * len(hs)) == len(hs)
        # A client asks for 24 MiB and reads one message: the daemon's only worker waits on its window.
        replies = raw(d).Load(pb.BlocksRequest(ns=ns_to_pb(BIG), hashes=hs), timeout=30)
        next(replies)
        # Another client is answered once the stalled Load is cancelled.
        assert raw(d).Lookup(pb.BlocksRequest(hashes=hs[:1]), timeout=15).blocks == 1
        assert d.servicer.stalls.cancelled == 1
        replies.cancel()
    finally:
        d.stop(grace_s=0)


def store_code(d: Daemon, messages) -> Code:
    try:
        raw(d).Store(messages, timeout=30)
        return Code.OK
    except grpc.RpcError as e:
        return e.code()


def test_a_store_stream_that_only_keeps_itself_alive_is_cut_off(start):
    import time

    d = start(workers=2, stream_idle_s=1.0)
    head = pb.StoreChunk(ns=ns_to_pb(NS), hashes=hashes(2), data=b"")
    # Empty messages after the first (each counted as progress) are refused at once.
    assert store_code(d, iter([head, pb.StoreChunk(), pb.StoreChunk()])) == Code.INVALID_ARGUMENT

    def trickle():  # a byte every half idle period: never idle, never done
        yield head
        for _ in range(60):
            time.sleep(0.5)
            yield pb.StoreChunk(data=b"x")
    # Bytes slower than the floor rate: cut off within a few idle periods, not held for the stream's life.
    t = time.monotonic()
    assert store_code(d, trickle()) == Code.DEADLINE_EXCEEDED and time.monotonic() - t < 10
