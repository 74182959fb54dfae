"""`tierkv serve` as a real subprocess: both data paths, restart, auth, SIGTERM drain, admin CLI."""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cache_service.blocks.objects import encode
from cache_service.sessions.manifests import Session
from cache_service.protocol.messages import ns_to_pb
from connectors.client import connect
from connectors.grpc.client import GrpcClient
from engine.cli import main
from proto import tierkv_pb2 as pb
from proto import tierkv_pb2_grpc as pb_grpc
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tests.integration.daemon_process import DaemonProcess
from tiers.types import TierUnavailableError

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "integration-token-0123456789"
pytestmark = pytest.mark.slow


def config(root: Path) -> str:
    """A CPU + disk (write-through) store rooted in `root`."""
    return (f'[tiers.cpu]\ncapacity = {64 * OBJ}\nslot_bytes = {OBJ}\n\n'
            f'[tiers.disk]\npath = "{root / "store"}"\ncapacity = "64MiB"\nwrite = "through"\n')


@pytest.fixture
def daemons(tmp_path):
    started: list[DaemonProcess] = []

    def make(*extra: str) -> DaemonProcess:
        started.append(DaemonProcess(tmp_path, config(tmp_path), "--log-format", "json", *extra))
        return started[-1]

    yield make
    for d in started:
        d.kill()


def cli(d: DaemonProcess, capsys, *args: str) -> tuple[int, str, str]:
    """Run `tierkv ARGS --url <daemon>`; (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main([*args, "--url", f"grpc://{d.address}"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def put(client, hs) -> int:
    return client.store(NS, hs, [payload_for(h) for h in hs])


def intact(client, hs) -> bool:
    return all(p is not None and same(p, payload_for(h)) for p, h in zip(client.load(NS, hs), hs))


def test_both_paths_round_trip_and_a_restart_keeps_disk_blocks(daemons):
    d = daemons().start()
    a, b = hashes(6), hashes(6, start=1000)
    shm, stream = connect(d.url("shm")), GrpcClient(d.url("stream"))
    assert (shm.transport, stream.transport) == ("shm", "stream")
    # each path stores, and each reads what the other stored (the same-host one into the daemon's shared pool)
    assert put(shm, a) == 6 and put(stream, b) == 6
    assert intact(shm, b) and intact(stream, a) and shm._near.pool is not None
    # SIGTERM: a clean exit after flushing the disk writes
    assert d.stop() == 0
    d.start()
    with GrpcClient(d.url("stream")) as fresh:
        assert fresh.lookup(a) == 6 and fresh.lookup(b) == 6 and intact(fresh, a + b)
        assert fresh.stats()["disk"]["blocks"] == 12
    # clients from before the restart recover by themselves (reconnect; a new segment for shm)
    deadline = time.monotonic() + 30
    while not (intact(shm, a) and intact(stream, b)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert intact(shm, a) and intact(stream, b) and shm.transport == "shm"
    assert shm.daemon_stats()["shm_attachments"] == 1  # attached anew to the new daemon
    # and stores into the new daemon's pool (mapped anew: the old one went with the old daemon)
    assert put(shm, hashes(3, start=2000)) == 3 and shm._near.pool is not None and intact(stream, hashes(3, start=2000))
    shm.close()
    stream.close()
    assert d.stop() == 0


def test_tokens_are_enforced_and_the_admin_cli_works(daemons, tmp_path, monkeypatch, capsys):
    (tmp_path / "tokens.txt").write_text(f"{TOKEN} acme\n")
    d = daemons("--token-file", str(tmp_path / "tokens.txt")).start()
    # a wrong or missing token is refused when connecting; the engine would run without cache
    for token in ("wrong-token-0123456789", None):
        with pytest.raises(TierUnavailableError, match="UNAUTHENTICATED"):
            GrpcClient(d.url(), token=token)
    # tierkv stats and tierkv sessions (the CLI, in this process) against the live daemon
    monkeypatch.setenv("TIERKV_TOKEN", "wrong-token-0123456789")
    rc, _, err = cli(d, capsys, "stats")
    assert rc == 2 and "UNAUTHENTICATED" in err
    monkeypatch.setenv("TIERKV_TOKEN", TOKEN)
    with GrpcClient(d.url()) as c:
        assert c.hello.tenant == "acme" and put(c, hashes(3)) == 3
        c.sessions.put(Session("agent-7", model_id="test-model", token_ids=[1, 2, 3]))
    rc, out, _ = cli(d, capsys, "stats", "--json")
    assert rc == 0 and json.loads(out)["tiers"]["cpu"]["blocks"] == 3
    assert json.loads(cli(d, capsys, "sessions", "list", "--json")[1]) == ["agent-7"]
    shown = json.loads(cli(d, capsys, "sessions", "show", "agent-7", "--json")[1])
    assert shown["tenant"] == "acme" and shown["token_ids"] == [1, 2, 3]
    assert cli(d, capsys, "sessions", "delete", "agent-7")[0] == 0
    assert cli(d, capsys, "sessions", "show", "agent-7")[0] == 1
    assert d.stop() == 0


def test_sigterm_lets_an_in_flight_store_finish(daemons):
    d = daemons("--grace", "30").start()
    hs, sent, release = hashes(4), threading.Event(), threading.Event()

    def stream():
        yield pb.StoreChunk(ns=ns_to_pb(NS), hashes=hs, data=b"".join(object_bytes(h) for h in hs[:2]))
        sent.set()
        release.wait(30)
        yield pb.StoreChunk(data=b"".join(object_bytes(h) for h in hs[2:]))

    channel = grpc.insecure_channel(d.address)
    call = pb_grpc.TierKVStub(channel).Store.future(stream())
    assert sent.wait(10)
    with GrpcClient(d.url("stream")) as probe:  # the daemon is handling the Store (the probe's Stats is the other)
        deadline = time.monotonic() + 30
        while probe.daemon_stats().get("rpcs_in_flight", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe.daemon_stats()["rpcs_in_flight"] >= 2
    # SIGTERM while the store is half sent: the daemon stops taking calls...
    d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while d.health() == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.health() != health_pb2.HealthCheckResponse.SERVING
    # ...but the call in flight completes, and the process exits cleanly after it
    release.set()
    assert call.result(timeout=30).stored == 4
    assert d.proc.wait(60) == 0
    channel.close()
    with GrpcClient(d.start().url()) as c:
        assert c.lookup(hs) == 4 and intact(c, hs)
    assert d.stop() == 0


def object_bytes(h: bytes) -> bytes:
    """Block h's object (header + payload), as Store streams carry them."""
    return encode(NS, h, payload_for(h)).numpy().tobytes()


def test_a_lookup_to_a_daemon_that_hangs_waits_the_lookup_timeout_not_the_data_timeout(daemons):
    d = daemons().start()
    d.client_timeout_s = 60.0
    hs = hashes(4)
    with GrpcClient(d.url("stream") + "&lookup_timeout=1") as c:
        assert put(c, hs) == 4 and c.lookup(hs) == 4
        # The daemon hangs: the scheduler's first lookup misses after the short lookup deadline.
        d.proc.send_signal(signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert c.lookup(hs) == 0 and time.monotonic() - t < d.client_timeout_s / 2
            assert c.breaker.open
        finally:
            d.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("transport", ["shm", "stream"])
def test_a_daemon_that_hangs_costs_one_timeout_not_one_per_call(daemons, transport):
    d = daemons().start()
    d.client_timeout_s = 2.0
    hs = hashes(8)
    with GrpcClient(d.url(transport)) as c:
        assert put(c, hs) == 8 and c.lookup(hs) == 8
        # The daemon hangs (stopped, as a stalled host): the first call waits out its timeout and misses.
        d.proc.send_signal(signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert c.lookup(hs) == 0 and time.monotonic() - t < 10
            # The next calls skip the cache at once: lookups and loads miss, stores are dropped, admin calls refuse.
            t = time.monotonic()
            assert c.lookup(hs) == 0 and c.load(NS, hs) == [None] * 8 and put(c, hashes(4, start=50)) == 0
            with pytest.raises(TierUnavailableError):
                c.stats()
            assert time.monotonic() - t < 0.5
        finally:
            d.proc.send_signal(signal.SIGCONT)
        # Once it answers again, the cache is back within seconds.
        deadline = time.monotonic() + 20
        while c.lookup(hs) != 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.lookup(hs) == 8 and intact(c, hs)
