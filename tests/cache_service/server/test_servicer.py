"""The gRPC daemon in-process (a real grpc server on a free port) and its client."""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cache_service.server.daemon import Daemon
from cache_service.blocks.keys import prefix_hashes
from cache_service.server.metrics import StructuredFormatter
from cache_service.config import ServerConfig
from cache_service.sessions.manifests import Session
from cache_service.protocol.segment import Segment
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from proto import tierkv_pb2_grpc as pb_grpc
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, make_store, payload_for, same
from tiers.types import TierUnavailableError

P = NS.payload_bytes
TOKENS = {"acme": "acme-token-0123456789", "globex": "globex-token-0123456789"}
Code = grpc.StatusCode


@pytest.fixture
def start(tmp_path):
    """Start daemons over fresh stores; all are stopped at the end."""
    daemons = []

    def _start(cpu_blocks: int = 64, disk: bool = True, auth: bool = False, shared: bool = False,
               tokens: dict | None = None, store_cfg: dict | None = None, **settings) -> Daemon:
        if auth or tokens:
            (tmp_path / "tokens.txt").write_text("".join(f"{t} {n}\n" for n, t in (tokens or TOKENS).items()))
            settings["token_file"] = str(tmp_path / "tokens.txt")
        store = make_store(tmp_path / f"store{len(daemons)}", cpu_blocks=cpu_blocks,
                           disk_blocks=4096 if disk else None, shared=shared, **(store_cfg or {}))
        settings.setdefault("listen", "127.0.0.1:0")
        s = ServerConfig(sessions_dir=str(tmp_path / "sessions"), **settings)
        daemons.append(Daemon(store, s).start())
        return daemons[-1]

    yield _start
    for d in daemons:
        d.stop(grace_s=0)


def url(d: Daemon, transport: str = "auto") -> str:
    return f"grpc://{d.address}?transport={transport}"


def raw(d: Daemon):
    return pb_grpc.TierKVStub(grpc.insecure_channel(d.address))


def bearer(tenant: str) -> tuple:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def put(client: GrpcClient, hs) -> int:
    return client.store(NS, hs, [payload_for(h) for h in hs])


def intact(client: GrpcClient, hs) -> bool:
    return all(p is not None and same(p, payload_for(h)) for p, h in zip(client.load(NS, hs), hs))


def scrape(d: Daemon) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ------------------------------------------------------------------ data paths
# "stream" goes over the daemon's data path (cache_service/server/data_path.py), "grpc" streams through gRPC (no data path),
# "pool" stores straight into the daemon's shared host pool (cache_service/server/pool.py); "stream-pool" streams
# into a daemon whose data path copies each object into a reserved pool slot as it checks it
TRANSPORTS = {"shm": ("shm", {}), "pool": ("shm", {"shared": True}), "stream": ("stream", {}),
              "stream-pool": ("stream", {"shared": True}), "grpc": ("stream", {"data_port": None})}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_round_trip_through_each_transport(start, transport):
    transport, settings = TRANSPORTS[transport]
    d = start(**settings)
    with GrpcClient(url(d, transport)) as c:
        assert c.transport == transport and (c._data_path is None) == ("data_port" in settings)
        hs = hashes(10)
        # store eight blocks; the daemon holds that prefix
        assert put(c, hs[:8]) == 8
        assert c.lookup(hs) == 8
        # a same-host client stored straight into the pool when the daemon shares it
        assert (c._near is not None and c._near.pool is not None) == ("shared" in settings and transport == "shm")
        # load returns the same bytes, None past the stored prefix
        out = c.load(NS, hs)
        assert intact(c, hs[:8]) and out[8:] == [None, None]
        assert out[0].shape == NS.block_shape and out[0].dtype == torch.bfloat16
        # storing again is not new to the top tier
        assert put(c, hs[:8]) == 0
        assert c.stats()["cpu"]["hits"] >= 16


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_batches_larger_than_a_message_or_segment(start, transport):
    # tiny chunks, read groups, data-path calls and segment: every batch boundary is crossed
    transport, settings = TRANSPORTS[transport]
    d = start(cpu_blocks=128, chunk_bytes=1000, load_batch_bytes=3 * P, **settings)
    with GrpcClient(url(d, transport), shm_bytes=5 * P) as c:
        hs = hashes(40)
        assert put(c, hs) == 40
        assert c.lookup(hs) == 40 and intact(c, hs)
        # misses interleaved with hits keep their positions
        mixed = [hs[0], *hashes(2, start=9000), hs[39]]
        assert [p is not None for p in c.load(NS, mixed)] == [True, False, False, True]


def test_auto_falls_back_to_streaming_when_the_daemon_cannot_map_the_segment(start, tmp_path):
    # a daemon looking in another shm directory behaves like one on another host
    (tmp_path / "elsewhere").mkdir()
    d = start(shm_dir=str(tmp_path / "elsewhere"))
    with GrpcClient(url(d, "auto")) as c:
        assert c.transport == "stream"
        assert put(c, hashes(3)) == 3 and intact(c, hashes(3))
    with pytest.raises(TierUnavailableError, match="shared memory"):
        GrpcClient(url(d, "shm"))
    # auto on the same host, shared /dev/shm: the fast path
    with GrpcClient(url(start(), "auto")) as c:
        assert c.transport == "shm"


def test_a_client_refuses_a_daemon_with_another_wire_format(start, monkeypatch):
    # a daemon of another wire version (its Load/Store would not parse): the client says so at connect
    d = start()
    monkeypatch.setattr("cache_service.server.servicer.WIRE_VERSION", "tierkv-daemon/1")
    with pytest.raises(TierUnavailableError, match="speaks 'tierkv-daemon/1'"):
        GrpcClient(url(d))


def test_delete_and_pins(start):
    d = start(cpu_blocks=16, disk=False)
    with GrpcClient(url(d)) as c:
        keep, rest = hashes(4), hashes(40, start=500)
        put(c, keep)
        c.pin(keep)
        # pinned blocks survive a flood that evicts everything else
        for i in range(0, 40, 8):
            put(c, rest[i:i + 8])
        assert c.lookup(keep) == 4 and c.lookup(rest[:8]) == 0
        c.unpin(keep)
        put(c, hashes(20, start=900))
        assert c.lookup(keep) < 4
        # delete removes what is left
        assert c.delete(hashes(20, start=900)) > 0 and c.lookup(hashes(20, start=900)) == 0


def test_one_tenant_cannot_pin_the_whole_tier(start):
    # acme may pin 4 blocks' worth (tenant_pin_bytes) of a 16-block tier
    d = start(cpu_blocks=16, disk=False, auth=True, store_cfg={"tenant_pin_bytes": 4 * OBJ})
    with GrpcClient(url(d), TOKENS["acme"]) as acme, GrpcClient(url(d), TOKENS["globex"]) as globex:
        put(acme, hashes(16))
        acme.pin(hashes(16) + hashes(1000, start=5000))  # and 1,000 blocks the store does not hold
        # its newest 4 stay pinned, none of the absent ones; globex's blocks land in the rest
        assert d.store.pins.stats()["pinned_blocks"] == 4
        put(globex, hashes(12, start=500))
        assert globex.lookup(hashes(12, start=500)) == 12 and acme.lookup(hashes(16)[12:]) == 4


def test_session_pins_and_prefetch_through_the_daemon(start):
    d = start(cpu_blocks=16, disk=True)
    with GrpcClient(url(d)) as c:
        keep, rest = hashes(4), hashes(40, start=500)
        put(c, keep)
        # A session pins its blocks; a flood through the CPU tier leaves them there.
        assert c.pin_session("", "agent-7", NS, keep, 60) == []
        for i in range(0, 40, 8):
            put(c, rest[i:i + 8])
        d.store.flush()
        assert d.store.tiers[0].contains_many(keep) == [True] * 4
        # Early flood blocks went down to disk; a prefetch brings them back up.
        early = rest[:2]
        assert d.store.tiers[0].contains_many(early) == [False, False]
        assert c.prefetch(NS, early) == 2
        d.store.flush()
        assert d.store.tiers[0].contains_many(early) == [True, True]
        # Release answers whether there was a pin; a malformed session id is refused.
        assert c.unpin_session("", "agent-7") is True and c.unpin_session("", "agent-7") is False
        with pytest.raises(Exception, match="session id"):
            c.pin_session("", "../x", NS, keep, 60)


# ------------------------------------------------------------------ sessions
def test_sessions_save_resume_pin_and_delete(start):
    d = start(cpu_blocks=16, disk=False)
    with GrpcClient(url(d)) as c:
        tokens = list(range(100, 116))  # four full blocks
        hs = prefix_hashes(NS, tokens)
        put(c, hs)
        s = Session("agent-7", model_id="test-model", messages=[{"role": "user", "content": "hi"}], token_ids=tokens)
        # saving with pin keeps the session's blocks through eviction pressure
        c.sessions.put(s, ns=NS, pin=True)
        assert s.updated_s > 0
        for i in range(0, 48, 8):
            put(c, hashes(8, start=2000 + 100 * i))
        got, cached = c.sessions.resume("agent-7", ns=NS)
        assert got.messages == s.messages and got.token_ids == tokens and cached == 4
        assert c.sessions.list() == ["agent-7"]
        # deleting (with ns) unpins; the blocks become ordinary victims
        assert c.sessions.delete("agent-7", ns=NS)
        put(c, hashes(20, start=7000))
        assert c.lookup(hs) < 4
        assert c.sessions.get("agent-7") is None and not c.sessions.delete("agent-7")


# ------------------------------------------------------------------ bad input
def _store_call(stub, first: pb.StoreChunk, *rest: pb.StoreChunk):
    return lambda: stub.Store(iter([first, *rest]))


def test_malformed_requests_get_clear_status_codes(start):
    d = start(max_blocks=64, max_request_bytes=32 * P, chunk_bytes=128 << 10, max_message_bytes=256 << 10)
    stub, ns, hs = raw(d), ns_to_pb(NS), hashes(4)
    with GrpcClient(url(d, "stream")) as c:  # something stored, to check nothing is lost afterwards
        put(c, hs)
    seg = Segment(4 * P)
    try:
        aid = stub.Attach(pb.AttachRequest(name=seg.name, nonce=seg.nonce)).attachment
        cases = [
            (lambda: stub.Lookup(pb.LookupRequest(hashes=[hs[0], b"short"])),
             Code.INVALID_ARGUMENT, "hashes[1] is 5 bytes"),
            (lambda: list(stub.Load(pb.LoadRequest(hashes=hs))), Code.INVALID_ARGUMENT, "no namespace"),
            (lambda: list(stub.Load(pb.LoadRequest(ns=pb.Namespace(model_id="m", kv_dtype="float64", num_layers=1,
                                                                    kv_heads=1, head_dim=1, block_tokens=1)))),
             Code.INVALID_ARGUMENT, "kv_dtype"),
            (lambda: list(stub.Load(pb.LoadRequest(ns=ns, hashes=hashes(65)))), Code.RESOURCE_EXHAUSTED, "limit is 64"),
            (_store_call(stub, pb.StoreChunk(ns=ns, hashes=hs, data=bytes(P))), Code.INVALID_ARGUMENT, "need"),
            (_store_call(stub, pb.StoreChunk(ns=ns, hashes=hs[:1], data=bytes(OBJ + 1))),
             Code.INVALID_ARGUMENT, "more than"),
            (_store_call(stub, pb.StoreChunk(ns=ns, hashes=hs[:1]), pb.StoreChunk(ns=ns, data=bytes(P))),
             Code.INVALID_ARGUMENT, "first Store message only"),
            (lambda: stub.Store(iter([])), Code.INVALID_ARGUMENT, "empty Store stream"),
            (_store_call(stub, pb.StoreChunk(ns=ns, hashes=hashes(33))), Code.RESOURCE_EXHAUSTED, "split the batch"),
            (_store_call(stub, pb.StoreChunk(ns=ns, hashes=hs[:1], data=bytes(300 << 10))),  # > max message
             Code.RESOURCE_EXHAUSTED, ""),
            (lambda: stub.LoadShm(pb.ShmRequest(ns=ns, hashes=hs, attachment="nope")),
             Code.NOT_FOUND, "unknown attachment"),
            (lambda: stub.StoreShm(pb.ShmRequest(ns=ns, hashes=hs, attachment=aid, offset=P)),
             Code.INVALID_ARGUMENT, "do not fit"),
            (lambda: stub.StoreShm(pb.ShmRequest(ns=ns, hashes=hs[:1], attachment=aid, offset=1)),
             Code.INVALID_ARGUMENT, "multiple of 64"),
            (lambda: stub.Attach(pb.AttachRequest(name="../etc/passwd")), Code.INVALID_ARGUMENT, "not tierkv-"),
            (lambda: stub.Attach(pb.AttachRequest(name="tierkv-missing")), Code.FAILED_PRECONDITION, "cannot open"),
            (lambda: stub.Attach(pb.AttachRequest(name=seg.name, nonce=bytes(16))), Code.PERMISSION_DENIED, "nonce"),
            (lambda: stub.SaveSession(pb.SaveSessionRequest(session=pb.Session(session_id="../x"))),
             Code.INVALID_ARGUMENT, "session id"),
            (lambda: stub.SaveSession(pb.SaveSessionRequest(session=pb.Session(session_id="s", messages_json="{"))),
             Code.INVALID_ARGUMENT, "not JSON"),
            (lambda: stub.SaveSession(pb.SaveSessionRequest(session=pb.Session(session_id="s"), pin=True)),
             Code.INVALID_ARGUMENT, "no namespace"),
            (lambda: stub.ListSessions(pb.ListSessionsRequest(tenant="a/b")), Code.INVALID_ARGUMENT, "tenant"),
        ]
        for call, want, fragment in cases:
            # each one answers with its code and a message saying what was wrong
            code, msg = code_of(call)
            assert code == want and fragment in msg, (want, fragment, code, msg)
    finally:
        seg.close()
    # the daemon is alive and lost nothing
    with GrpcClient(url(d, "stream")) as c:
        assert c.lookup(hs) == 4 and intact(c, hs)


def test_a_client_vanishing_mid_store_stores_nothing(start):
    d = start(metrics_port=0)
    hs = hashes(4)
    sent, gate, handled = threading.Event(), threading.Event(), threading.Event()
    parse = d.servicer._blocks

    def parsed_then_signal(*args):  # the handler has read the first message
        out = parse(*args)
        handled.set()
        return out

    d.servicer._blocks = parsed_then_signal

    def stream():
        yield pb.StoreChunk(ns=ns_to_pb(NS), hashes=hs, data=bytes(P))
        sent.set()
        gate.wait(10)
        yield pb.StoreChunk(data=bytes(3 * P))

    # the client sends the first quarter, then goes away
    call = raw(d).Store.future(stream())
    assert sent.wait(10) and handled.wait(30)
    call.cancel()
    gate.set()
    key = ("tierkv_rpc_total", (("code", "CANCELLED"), ("method", "Store"), ("tenant", "-")))
    deadline = time.monotonic() + 10
    while scrape(d).get(key) != 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(d).get(key) == 1.0
    with GrpcClient(url(d)) as c:
        assert c.lookup(hs) == 0
        assert put(c, hs) == 4 and intact(c, hs)


def test_a_store_stream_that_ends_short_is_refused_and_stores_nothing(start):
    d = start()
    hs = hashes(4)
    # the client sends one block's bytes for four hashes, then closes its stream and waits for the answer
    stream = iter([pb.StoreChunk(ns=ns_to_pb(NS), hashes=hs, data=bytes(P))])
    with pytest.raises(grpc.RpcError) as err:
        raw(d).Store(stream)
    # refused as the client's mistake, not taken for a cancellation
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "need" in err.value.details()
    with GrpcClient(url(d)) as c:
        assert c.lookup(hs) == 0


def test_failures_mid_run_are_misses_not_crashes(start, caplog):
    d = start()
    c = GrpcClient(url(d, "shm"))
    hs = hashes(3)
    put(c, hs)
    d.stop(grace_s=0)
    # the daemon is gone: lookups and loads miss, stores drop, all logged once
    with caplog.at_level(logging.WARNING, logger="tierkv.client"):
        assert c.lookup(hs) == 0
        assert c.load(NS, hs) == [None] * 3
        assert put(c, hs) == 0
        assert put(c, hs) == 0
    assert c.errors == 4
    # the shared-memory segment was given up (the daemon may never have finished with it)
    assert c.transport == "stream"
    assert sum("store failed" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(TierUnavailableError):
        c.stats()
    # argument errors are still the caller's: raised, as the embedded store does
    with pytest.raises(ValueError, match="payload"):
        c.store(NS, hs[:1], [torch.zeros(3)])
    c.close()
    # nothing listening at all: TierUnavailableError at connect time
    with pytest.raises(TierUnavailableError, match="cannot reach"):
        GrpcClient(f"grpc://{d.address}", connect_timeout_s=0.5)


# ------------------------------------------------------------------ observability
def test_metrics_report_tiers_rpcs_and_latency(start):
    d = start(metrics_port=0)
    with GrpcClient(url(d)) as c:
        hs = hashes(5)
        put(c, hs)
        c.load(NS, hs + hashes(1, start=777))
        stats = c.stats()
        m = scrape(d)
    # tier counters come from store.stats() at scrape time
    assert m[("tierkv_tier_hits_total", (("tier", "cpu"),))] == stats["cpu"]["hits"] == 5
    assert m[("tierkv_tier_misses_total", (("tier", "cpu"),))] == stats["cpu"]["misses"] == 1
    assert m[("tierkv_tier_blocks", (("tier", "cpu"),))] == 5
    assert ("tierkv_tier_queue_depth", (("tier", "disk"),)) in m
    # one latency observation per RPC, labelled by method
    assert m[("tierkv_rpc_seconds_count", (("method", "LoadShm"),))] == 1
    assert m[("tierkv_rpc_total", (("code", "OK"), ("method", "StoreShm"), ("tenant", "-")))] == 1
    assert m[("tierkv_shm_attachments", ())] == 1
    # closing the client detaches its segment; pins are reported (pins_yielded as a counter)
    with GrpcClient(url(d)) as c:
        c.pin(hs[:2])
    m = scrape(d)
    assert m[("tierkv_shm_attachments", ())] == 0
    assert m[("tierkv_pinned_blocks", ())] == 2 and m[("tierkv_pins_yielded_total", ())] == 0


def test_structured_log_lines():
    rec = logging.LogRecord("tierkv.server", logging.INFO, __file__, 1, "serving", None, None)
    rec.fields = {"listen": "127.0.0.1:7600", "note": "two words"}
    line = json.loads(StructuredFormatter(json_lines=True).format(rec))
    assert line["msg"] == "serving" and line["listen"] == "127.0.0.1:7600" and line["level"] == "info"
    text = StructuredFormatter().format(rec)
    assert "msg=serving" in text and 'note="two words"' in text
