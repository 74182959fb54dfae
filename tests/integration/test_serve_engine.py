"""`tierkv serve-engine` with real servers: a session begun on one node
continues on another (separate disks, shared S3 + Redis) with the answer of a
node that never lost the KV; a cache daemon that dies mid-run costs the cache,
never a request."""
from __future__ import annotations

import json
import uuid

import pytest

from engine.models import resolve_model
from tests.engine.server.engine_server import EngineServer
from tests.integration.daemon_process import DaemonProcess, free_port

pytestmark = pytest.mark.slow
MODEL = "smollm2"
DOC = "Notes from the field trip. " + " ".join(f"Stop {i}: the group measured {i * 13 % 71} plants." for i in range(40))


def toml(s3_server, bucket: str, redis_url: str, prefix: str, node: str, disk) -> str:
    return f"""
[tiers.cpu]
capacity = "64MiB"
[tiers.disk]
path = "{disk}"
capacity = "256MiB"
fsync = false
[tiers.s3]
bucket = "{bucket}"
prefix = "{prefix}"
endpoint = "{s3_server.endpoint}"
access_key = "{s3_server.access_key}"
secret_key = "{s3_server.secret_key}"
capacity = "1GiB"
[directory]
url = "{redis_url}"
prefix = "{prefix}"
node_id = "{node}"
"""


def ask(client, messages, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          extra_body=extra or None)


def test_a_session_begun_on_one_server_continues_on_another(s3_server, s3_bucket, redis_url, tmp_path, capsys):
    prefix = f"se-{uuid.uuid4().hex[:8]}"
    servers = {}
    for node in ("a", "b"):
        cfg = tmp_path / f"{node}.toml"
        cfg.write_text(toml(s3_server, s3_bucket, redis_url, prefix, node, tmp_path / f"disk-{node}"))
        servers[node] = EngineServer(tmp_path / f"{node}.log", "--model", str(resolve_model(MODEL)),
                                     "--served-model-name", MODEL, "--dtype", "float32",
                                     "--kv-connector", "local://", "--config", str(cfg), "--no-enable-prefix-caching",
                                     env={"TIERKV_CACHE_DIR": str(tmp_path / f"cache-{node}")})
    try:
        a, b = servers["a"].client(), servers["b"].client()
        hint = {"kv_transfer_params": {"tierkv": {"session": "trip", "retain_s": 600}}}
        messages = [{"role": "user", "content": DOC + "\nHow many stops were there?"}]
        # Two turns on A, with the session hint (pinned, manifest recorded once its blocks reached S3).
        for follow_up in ("Which stop had the most plants?", "Summarize the trip in one sentence."):
            r = ask(a, messages, **hint)
            assert r.model_extra["tierkv"]["session"]["pinned_blocks"] > 0
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": follow_up}]
        # The third turn goes to B: its own disk is empty, the earlier conversation comes from S3.
        on_b = ask(b, messages, **hint)
        # The same turn on A, which never lost the KV, gives the same answer.
        on_a = ask(a, messages)
        with capsys.disabled():
            print(f"\n  turn 3: B loaded {on_b.usage.prompt_tokens_details.cached_tokens} of "
                  f"{on_b.usage.prompt_tokens} prompt tokens from the cache; A {on_a.usage.prompt_tokens_details.cached_tokens}")
        assert on_b.choices[0].message.content == on_a.choices[0].message.content
        assert on_b.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens // 16 * 16 > 0
        assert 'tierkv_tier_hits{tier="s3"}' in servers["b"].get("/metrics")
        # B prefetches the session it now knows from the shared manifest (its blocks are in its CPU tier already).
        assert json.loads(servers["b"].post("/v1/sessions/trip/prefetch"))["session"] == "trip"
    finally:
        for s in servers.values():
            s.close()


def test_a_dead_cache_daemon_costs_the_cache_never_a_request(tmp_path):
    daemon = DaemonProcess(tmp_path / "daemon", '[tiers.cpu]\ncapacity = "64MiB"\n').start()
    server = EngineServer(tmp_path / "server.log", "--model", "tiny-random", "--dtype", "float32",
                          "--kv-connector", daemon.url(), "--no-enable-prefix-caching")
    try:
        client = server.client()
        prompt = " ".join(f"word{i}" for i in range(80))
        # With the daemon up, the second identical request is served from the cache.
        client.completions.create(model="tiny-random", prompt=prompt, max_tokens=4, temperature=0)
        warm = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=4, temperature=0)
        assert warm.usage.prompt_tokens_details.cached_tokens > 0
        # The daemon dies; requests (hinted ones too) still succeed, computed from scratch, same text.
        daemon.kill()
        cold = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body={"kv_transfer_params": {"tierkv": {"session": "s", "retain_s": 9}}})
        assert cold.choices[0].text == warm.choices[0].text
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        # The failures are counted where an operator looks.
        errors = [ln for ln in server.get("/metrics").splitlines() if ln.startswith("tierkv_engine_kv_cache_errors")]
        assert errors and float(errors[0].split()[-1]) > 0
    finally:
        server.close()
        daemon.kill()
    # A server whose cache is unreachable from the start serves without it.
    nowhere = EngineServer(tmp_path / "nowhere.log", "--model", "tiny-random", "--kv-connector",
                           f"grpc://127.0.0.1:{free_port()}")
    try:
        r = nowhere.client().completions.create(model="tiny-random", prompt="hello there", max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert "serving without the KV cache" in nowhere.log.read_text()
    finally:
        nowhere.close()
