"""Two nodes (separate processes, separate disks) sharing Redis and Ceph's S3:
a session saved on node A is resumed on node B after A is SIGKILLed, every
block loads byte-identical and the conversation continues exactly as on an
engine that never lost its KV; `tierkv generate --session` does the same from
the command line; a second tenant sees nothing of the first."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from cache_service.config import load_config
from cache_service.factory import open_sessions, open_store
from cache_service.blocks.keys import prefix_hashes
from cache_service.sessions.manifests import Session, SessionManager
from engine import LLM, SamplingParams
from tests.cache_service.sessions.tenant_view import TenantView
from tests.cache_service.store.store_helpers import NS, payload_for, same
from tests.integration.conftest import S3Server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TURN1 = "The directory says which node holds a block, and the bucket holds them all. " * 3
TURN2 = "Now continue the story on another machine, please."


@pytest.fixture(params=["redis", "redis-cluster"])
def directory(request) -> dict:
    """The [directory] section for a single Redis or the 3-node cluster, on a fresh key prefix."""
    if request.param == "redis":
        target = {"url": request.getfixturevalue("redis_url")}
    else:
        target = {"cluster": ",".join(f"{h}:{p}" for h, p in request.getfixturevalue("redis_cluster_nodes"))}
    return target | {"prefix": f"xn-{uuid.uuid4().hex[:8]}", "heartbeat_ttl_s": 2.0}


@pytest.fixture
def node_config(s3_server: S3Server, s3_bucket: str, directory: dict, tmp_path):
    """`node_config(name)`: overrides for a node with its own disk, sharing S3 and Redis."""
    prefix = f"xn-{uuid.uuid4().hex[:8]}"

    def make(name: str, **tiers) -> dict:
        return {"tiers": {"cpu": {"capacity": "64MiB"},
                          "disk": {"path": str(tmp_path / name), "capacity": "256MiB", "fsync": False},
                          "s3": {"bucket": s3_bucket, "prefix": prefix, "endpoint": s3_server.endpoint,
                                 "capacity": "1GiB", "access_key": s3_server.access_key,
                                 "secret_key": s3_server.secret_key}} | tiers,
                "directory": directory | {"node_id": name}}

    return make


class NodeProcess:
    """A node_proc child: JSON commands in, JSON replies out."""

    def __init__(self, cfg: dict) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.node_proc", json.dumps(cfg)],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"node exited with {self.proc.wait()}"
        return json.loads(line)

    def ask(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op} | kw) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)


@pytest.fixture(scope="module")
def reference_conversation() -> tuple[list[int], list[int]]:
    """Both turns on one engine that keeps its KV the whole time (no connector)."""
    torch.set_num_threads(1)
    llm = LLM("tiny-random", dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompt1 = llm.tokenizer.encode(TURN1)
    out1 = llm.generate([prompt1], greedy)[0].token_ids
    out2 = llm.generate([prompt1 + out1 + llm.tokenizer.encode(TURN2)], greedy)[0]
    assert out2.num_local_cached_tokens > 0  # it really reused its own KV
    return out1, out2.token_ids


def test_session_resumes_on_another_node_after_sigkill(node_config, reference_conversation):
    # Both nodes start together (B's S3 view is empty: it can only learn of A's blocks from Redis).
    a, b = NodeProcess(node_config("node-a")), NodeProcess(node_config("node-b"))
    try:
        assert a.read() == {"ready": "node-a"} and b.read() == {"ready": "node-b"}
        ref1, ref2 = reference_conversation
        # A answers the first turn and saves the session (blocks flushed to S3 first).
        first = a.ask("turn", tenant="acme", session="chat-1", text=TURN1, max_tokens=24)
        assert first["output"] == ref1
        stored = a.ask("digests", tenant="acme", session="chat-1")["digests"]
        held = len(stored) - stored.count(None)
        assert held >= 3 and None not in stored[:held]
        # A dies without a chance to clean up; its heartbeat record expires.
        a.kill()
        deadline = time.monotonic() + 30
        while "node-a" in b.ask("nodes")["nodes"]:
            assert time.monotonic() < deadline, "node A's record never expired"
            time.sleep(0.5)
        # B resumes: same tokens, every stored block loadable now, byte-identical.
        resumed = b.ask("resume", tenant="acme", session="chat-1")
        assert resumed == {"found": True, "tokens": first["tokens"], "loadable": held * 16}
        assert b.ask("digests", tenant="acme", session="chat-1")["digests"][:held] == stored[:held]
        # B continues the conversation: the prefix is loaded, the answer is the reference's.
        second = b.ask("turn", tenant="acme", session="chat-1", text=TURN2, max_tokens=24)
        assert second["loadable"] == held * 16
        assert second["cached_tokens"] == held * 16
        assert second["output"] == ref2
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("directory", ["redis"], indirect=True)  # the cluster variant adds nothing here
def test_cli_session_started_on_one_node_continues_on_another(node_config, tmp_path):
    cfg_a, cfg_b = node_config("cli-a"), node_config("cli-b")
    s3, d = cfg_a["tiers"]["s3"], cfg_a["directory"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERKV_CACHE_DIR=str(tmp_path / "cache"),
               **{f"TIERKV_TIERS__S3__{k.upper()}": str(v) for k, v in s3.items()},
               **{f"TIERKV_DIRECTORY__{k.upper()}": str(v) for k, v in d.items() if k != "node_id"})

    def generate(node: str, prompt: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--json", "--model", "tiny-random",
                              "--dtype", "float32", "--max-tokens", "8", "--session", "trip", "--tenant", "acme",
                              "--prompt", prompt, "--kv-connector", f"local://{tmp_path / node}"],
                             capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    # Node A starts the session; node B (another disk, no local files) continues it.
    first = generate("cli-a", TURN1)
    second = generate("cli-b", TURN2)
    # B's prompt held A's turn (history from the shared manifest) and its KV came from S3.
    assert second["prompt_tokens"] > first["prompt_tokens"] + len(first["token_ids"])
    assert second["cached_tokens"] >= first["prompt_tokens"] // 16 * 16 > 0
    assert second["tier_hits"].get("s3", 0) > 0
    # The manifest both nodes share holds both turns.
    store = open_store(load_config(env={}, overrides=cfg_b))
    try:
        s = open_sessions(load_config(env={}, overrides=cfg_b), tmp_path, store).get("trip", "acme")
        assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
        assert s.messages[2]["content"] == TURN2
    finally:
        store.close()


def test_a_second_tenant_sees_nothing_of_the_first(node_config):
    cfg_a, cfg_b = node_config("ten-a"), node_config("ten-b")
    a, b = open_store(load_config(env={}, overrides=cfg_a)), open_store(load_config(env={}, overrides=cfg_b))
    try:
        acme_a = SessionManager(a, open_sessions(load_config(env={}, overrides=cfg_a), "/nonexistent", a),
                                durable_timeout_s=60.0)
        mgr_b = SessionManager(b, open_sessions(load_config(env={}, overrides=cfg_b), "/nonexistent", b))
        # acme stores a prompt's blocks on node A and saves its session.
        tokens = list(range(500, 500 + 4 * 8))
        hs = prefix_hashes(NS, tokens)
        TenantView(a, "acme").store(NS, hs, [payload_for(h) for h in hs])
        acme_a.save(Session("plan", tenant="acme", namespace=NS.fingerprint().hex(), token_ids=tokens), NS,
                    key_tenant="acme")
        # acme on node B finds all of it.
        assert mgr_b.resume("acme", "plan", NS, key_tenant="acme")[1] * NS.block_tokens == 32
        # globex on node B, even with acme's exact hashes and session id: nothing.
        globex = TenantView(b, "globex")
        assert globex.lookup(hs) == 0
        assert globex.load(NS, hs) == [None] * 8
        assert mgr_b.resume("globex", "plan", NS, key_tenant="globex") == (None, 0)
        assert mgr_b.list("globex") == [] and mgr_b.list("acme") == ["plan"]
        # nor through the untenanted view of the store: the stored keys are salted by tenant
        assert b.lookup(hs) == 0
        # and globex's probing quarantined nothing: acme still loads every block intact
        got = TenantView(b, "acme").load(NS, hs)
        assert all(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))
        assert all(t["corrupt"] == 0 for t in list(a.stats().values()) + list(b.stats().values()))
    finally:
        a.close()
        b.close()


def test_sessions_saved_through_one_daemon_resume_through_another(node_config):
    # two daemons (`tierkv serve` builds them so), each with its own disk, sharing Redis and S3
    from connectors.grpc.client import GrpcClient
    from cache_service.server.daemon import open_daemon

    cfgs = [load_config(env={}, overrides=node_config(name) | {"server": {"listen": "127.0.0.1:0"}})
            for name in ("daemon-a", "daemon-b")]
    daemons = [open_daemon(cfg).start() for cfg in cfgs]
    clients = [GrpcClient(f"grpc://{d.address}") for d in daemons]
    try:
        # a conversation saved through daemon A, its blocks stored there
        ids = list(range(100, 100 + 4 * NS.block_tokens))
        hashes = prefix_hashes(NS, ids)
        clients[0].store(NS, hashes, [payload_for(h) for h in hashes])
        clients[0].sessions.put(Session("trip", model_id=NS.model_id, namespace=NS.fingerprint().hex(),
                                        token_ids=ids, block_tokens=NS.block_tokens))
        # daemon B holds none of the blocks itself, but knows them in S3 (what its Pin call pins)
        assert daemons[1].store.tiers[0].contains_many(hashes) == [False] * 4 and all(daemons[1].store.holds(hashes))
        # daemon B lists the session, and resumes it with every block loadable (from S3, through B)
        assert clients[1].sessions.list() == ["trip"]
        s, held = clients[1].sessions.resume("trip", ns=NS)
        assert s is not None and s.token_ids == ids and held == len(hashes)
        assert all(same(got, payload_for(h)) for got, h in zip(clients[1].load(NS, hashes), hashes))
    finally:
        for c in clients:
            c.close()
        for d in daemons:
            d.stop(grace_s=1.0)
