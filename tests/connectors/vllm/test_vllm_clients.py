"""The vLLM connector's clients (connectors/vllm/clients.py, lookup.py) when
the cache cannot be opened, is held by another vLLM instance, or answers
slowly: a worker side is never off while its scheduler side plans for it, and
a scheduler asks its own instance's worker only.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.protocol.socket_client import SocketClient
from cache_service.sessions.manifests import SessionStore
from connectors.client import connect
from connectors.session_hints import SessionHint, SessionKeeper
from connectors.vllm import clients
from connectors.vllm.clients import CacheNotOpen, LateClient
from connectors.vllm.lookup import LookupServer, RemoteLookup, lookup_address
from connectors.vllm.scheduler import SchedulerSide, Transfer
from connectors.vllm.worker import WorkerSide
from tests.connectors.vllm.oracle import tokens
from tests.integration.conftest import in_ci
from tiers.types import TierUnavailableError

NS = Namespace("unit-model", "bfloat16", num_layers=2, kv_heads=2, head_dim=8, block_tokens=16)


def stored(client, ids: list[int], n_blocks: int) -> None:
    hs = prefix_hashes(NS, ids)[:n_blocks]
    client.store(NS, hs, [torch.randn(NS.block_shape).to(torch.bfloat16) for _ in hs])


def opened(url: str, worker: bool, instance: str):
    """What `acquire` gives a process of vLLM instance `instance` (each test process holds one entry per URL)."""
    entry = [None, 1, None]
    entry[0] = clients._open(url, worker, instance, entry)
    return entry


def test_a_second_instance_on_the_same_directory_never_loads_the_first_ones_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(LateClient, "RETRY_S", 0.2)
    url = f"local://{tmp_path}/store"
    x = tokens(700, 9)
    # instance A's worker owns the directory, stores 20 blocks and serves A's scheduler
    a = opened(url, worker=True, instance="A")
    stored(a[0], x, 20)
    assert RemoteLookup(lookup_address(url, "A")).lookup(prefix_hashes(NS, x)) == 20
    # instance B's worker cannot open the directory: it gets a client that fails every call, not None
    b = opened(url, worker=True, instance="B")
    assert isinstance(b[0], LateClient)
    with pytest.raises(CacheNotOpen):
        b[0].lookup(prefix_hashes(NS, x))
    # B's scheduler asks B's own worker, which serves nothing: a miss, never A's 20 blocks
    b_sched = opened(url, worker=False, instance="B")[0]
    assert isinstance(b_sched, RemoteLookup)
    assert SchedulerSide(b_sched, NS, 128).matched_tokens("r", x, 0, "") == 0
    # had B planned a load anyway, its worker reports every page failed (vLLM recomputes them)
    worker = WorkerSide(b[0], NS, 16)
    worker.register({f"model.layers.{i}.self_attn.attn": torch.zeros(2, 8, 16, NS.kv_heads, NS.head_dim,
                                                                      dtype=torch.bfloat16) for i in range(2)})
    worker.load([Transfer("r", x[:64], 0, 64, [0, 1, 2, 3])])
    assert worker.take_invalid_pages() == {0, 1, 2, 3} and worker.take_failed() == {"r": 0}
    # once A lets the directory go, B's worker opens it in the background and serves B's scheduler
    clients._close(a)
    assert until_open(b[0]).lookup(prefix_hashes(NS, x)) == 20
    assert RemoteLookup(lookup_address(url, "B")).lookup(prefix_hashes(NS, x)) == 20
    clients._close(b)


def until_open(late: LateClient, timeout_s: float = 10.0) -> LateClient:
    """`late` once its background attempt opened it (each call until then raises CacheNotOpen at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            late.lookup
            return late
        except CacheNotOpen:
            time.sleep(0.05)
    raise AssertionError("the cache never opened")


def test_a_daemon_that_does_not_answer_never_holds_up_a_call(monkeypatch):
    # a daemon that accepts connections but never answers Hello: the reopen waits for it in the background
    monkeypatch.setattr(LateClient, "RETRY_S", 0.05)
    hung = socket.create_server(("127.0.0.1", 0))
    late = LateClient(f"grpc://127.0.0.1:{hung.getsockname()[1]}", "down", lambda c: None)
    time.sleep(0.1)
    for _ in range(5):  # each call (a load in vLLM's step, a save) fails at once
        t0 = time.monotonic()
        with pytest.raises(CacheNotOpen):
            late.load(NS, [])
        assert time.monotonic() - t0 < 0.05
    late.close()
    hung.close()


def test_a_daemon_down_at_startup_gets_a_new_reason_at_each_try(monkeypatch):
    # grpc:// with nothing listening: the worker's client fails (a miss / failed load) instead of being off
    monkeypatch.setattr(LateClient, "RETRY_S", 0.05)
    seen = []
    late = LateClient("grpc://127.0.0.1:1", "down", seen.append)
    with pytest.raises(CacheNotOpen, match="down"):
        late.load(NS, [])
    time.sleep(0.1)
    with pytest.raises(CacheNotOpen):
        late.store(NS, [], [])  # starts the background try
    time.sleep(0.5)
    with pytest.raises(CacheNotOpen, match="127.0.0.1:1"):  # its reason, once it failed
        late.store(NS, [], [])
    assert seen == []
    late.close()


class SlowStore:
    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.calls = delay_s, 0

    def lookup(self, hashes) -> int:
        self.calls += 1
        time.sleep(self.delay_s)
        return len(hashes)


def test_a_slow_worker_costs_one_timeout_then_lookups_miss_without_asking(monkeypatch):
    # the scheduler's step runs lookups inline: a worker slower than the timeout is not asked twice
    address = f"\0tierkv-test-slow-{os.getpid()}"
    store = SlowStore(0.6)
    server = LookupServer(store, address)
    try:
        remote = RemoteLookup(address, timeout_s=0.3)
        hs = prefix_hashes(NS, tokens(64, 1))
        t0 = time.monotonic()
        assert remote.lookup(hs) == 0
        assert time.monotonic() - t0 < 0.55 and remote.errors == 1
        # for QUIET_S after it, lookups miss at once without reaching the worker
        t0 = time.monotonic()
        assert remote.lookup(hs) == 0 and time.monotonic() - t0 < 0.05
        time.sleep(0.7)
        assert store.calls == 1
        # once the quiet time is over (and the worker is fast again) the lookup is answered
        store.delay_s = 0
        monkeypatch.setattr(remote, "_quiet_until", 0.0)
        assert remote.lookup(hs) == len(hs)
        remote.close()
    finally:
        server.close()


def test_another_users_process_can_neither_serve_nor_ask_the_lookup_socket():
    # an abstract socket has no permissions: each end checks the other's user id
    if os.getuid() != 0:  # CI runs as root: there this is a failure
        why = "needs root to run a server as another user"
        pytest.fail(why) if in_ci() else pytest.skip(why)
    address = f"\0tierkv-test-user-{os.getpid()}"
    squatter = subprocess.Popen(
        [sys.executable, "-c", (
            "import os, socket, sys, time; os.setgid(65534); os.setuid(65534)\n"
            f"s = socket.socket(socket.AF_UNIX); s.bind({address!r}); s.listen(8); print('up', flush=True)\n"
            "time.sleep(30)")], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        # a name bound first by another user is not trusted: the scheduler sees a miss, not the squatter's answer
        with pytest.raises(PermissionError, match="another user"):
            SocketClient(address, None, 1.0)
        assert RemoteLookup(address, timeout_s=1.0).lookup(prefix_hashes(NS, tokens(64, 1))) == 0
    finally:
        squatter.kill()
        squatter.wait()
    # and our server closes connections from another user before their HELLO
    own = f"\0tierkv-test-own-{os.getpid()}"
    server = LookupServer(SlowStore(0.0), own)
    try:
        probe = subprocess.run(
            [sys.executable, "-c", (
                "import os, socket; os.setgid(65534); os.setuid(65534)\n"
                f"s = socket.socket(socket.AF_UNIX); s.connect({own!r}); s.settimeout(5)\n"
                "print('closed' if s.recv(1) == b'' else 'open')")], capture_output=True, text=True, timeout=20)
        assert probe.stdout.strip() == "closed", probe.stderr
        assert RemoteLookup(own).lookup(prefix_hashes(NS, tokens(64, 1))) == 4  # ours is served
    finally:
        server.close()


def test_a_schedulers_session_hints_act_on_its_workers_store(tmp_path):
    # the worker owns the store; the scheduler, in another process, hints over the lookup socket
    url = f"local://{tmp_path}/store"
    store = connect(url)
    server = LookupServer(store, lookup_address(url, "A"))
    remote = RemoteLookup(lookup_address(url, "A"))
    try:
        x = tokens(160, 5)
        stored(store, x, 10)
        keeper = SessionKeeper(remote, NS, SessionStore(tmp_path / "manifests"))
        # a retain_s hint pins the conversation's ten blocks in the worker's store and records the session
        assert keeper.finished(SessionHint("agent-7", retain_s=60), x)["pinned_blocks"] == 10
        assert store.pins.session_pins("") == {"agent-7": 10}
        # a prefetch of the recorded session reaches the store (its blocks are all in the top tier: none queued)
        assert keeper.prefetch("agent-7") == 0
        # a release unpins it; a malformed call is refused, and the socket goes on serving lookups
        assert keeper.finished(SessionHint("agent-7", release=True), x)["released"]
        assert store.pins.session_pins("") == {}
        with pytest.raises(TierUnavailableError, match="INVALID_ARGUMENT"):
            remote.unpin_session("", "../etc")
        assert remote.lookup(prefix_hashes(NS, x)) == 10
    finally:
        remote.close()
        server.close()
        store.close()


def test_a_request_is_new_to_the_scheduler_once(tmp_path):
    # session hints act at a request's first sight: vLLM asks again while it waits and after a preemption
    client = connect(f"local://{tmp_path}/store")
    sched = SchedulerSide(client, NS, 128)
    assert not sched.knows("r")
    sched.matched_tokens("r", tokens(300, 2), 128, "")  # with vLLM's own hit of a page: still its first sight
    assert sched.knows("r") and not sched.knows("q")
    sched.finished("r")
    assert not sched.knows("r")
    client.close()


def test_a_client_closed_while_it_opens_leaves_no_lookup_server(tmp_path, monkeypatch):
    # instance B's worker opens the directory in the background as A lets it go; vLLM shuts B down meanwhile
    monkeypatch.setattr(LateClient, "RETRY_S", 0.05)
    url = f"local://{tmp_path}/store"
    a, b = opened(url, worker=True, instance="A"), opened(url, worker=True, instance="B")
    real = clients.LookupServer
    monkeypatch.setattr(clients, "LookupServer", lambda store, address: time.sleep(0.5) or real(store, address))
    clients._close(a)
    time.sleep(0.1)
    with pytest.raises(CacheNotOpen):
        b[0].lookup([])  # starts the background open, which takes a while to start its lookup server
    time.sleep(0.2)
    clients._close(b)
    time.sleep(1.0)
    # what it started for the closed client went with it: B's worker, started again, serves its scheduler
    monkeypatch.setattr(clients, "LookupServer", real)
    again = opened(url, worker=True, instance="B")
    assert again[2] is not None
    clients._close(again)
