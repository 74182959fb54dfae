"""Our engine through the real embedded store: KV loaded in a new process is
bit-identical to computed KV, and answers do not change."""
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from cache_service.blocks.keys import chain_hashes, prefix_hashes
from connectors.client import connect
from connectors.engine import EngineConnector
from engine import LLM, SamplingParams
from tests.tiers.disk_objects import read_at, write_at

ROOT = Path(__file__).resolve().parents[2]
TEXT = ("The cache keeps keys and values of earlier prompts so that a long shared prefix is loaded, "
        "not recomputed. ") * 6 + "Question: what does the cache keep?"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cli(*args: str, env_extra: dict | None = None) -> dict:
    """Run `tierkv generate ... --json` in a new process and parse its answer."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    dtype = [] if "--dtype" in args else ["--dtype", "bfloat16"]  # as the in-process engines here
    out = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--json", *dtype, *args],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def pages_of(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """KV of the full pages of `tokens` in `llm`'s prefix cache, [L, 2, T, H, D]."""
    pages = [llm.blocks.hash_to_page[h] for h in chain_hashes(llm.fingerprint, tokens, llm.page_size)]
    return llm.kv_cache[:, :, pages].flatten(2, 3)


def engine(url: str | None, dtype: str = "bfloat16", **kw) -> tuple[LLM, EngineConnector | None]:
    llm = LLM("tiny-random", dtype=dtype, kv_cache_bytes=64 << 20, **kw)
    conn = None
    if url:
        conn = EngineConnector(connect(url), llm.kv_namespace(16), llm.page_size)
        llm.set_kv_connector(conn)
    return llm, conn


def test_kv_loaded_in_a_new_process_is_bit_identical_and_the_answer_unchanged(tmp_path):
    url = f"local://{tmp_path}/store"
    # a first process answers cold and offloads the prompt's blocks
    cold = cli("--model", "tiny-random", "--prompt", TEXT, "--kv-connector", url, "--max-tokens", "12")
    assert cold["cached_tokens"] == 0
    # this process loads them: the whole block-aligned prefix, all from disk
    llm, conn = engine(url)
    prompt = llm.apply_chat_template([{"role": "user", "content": TEXT}])
    warm = llm.generate([prompt], SamplingParams(max_tokens=12))[0]
    aligned = (len(prompt) - 1) // 16 * 16
    assert warm.num_cached_tokens == aligned == cold["prompt_tokens"] - 1 - (cold["prompt_tokens"] - 1) % 16
    assert conn.stats.tier_hits.get("disk", 0) == aligned // 16
    loaded = pages_of(llm, prompt[:aligned])
    conn.close()
    # a control engine without the service computes the same tokens' KV: bit-identical
    ctl, _ = engine(None)
    ctl.generate([prompt], SamplingParams(max_tokens=1))
    computed = pages_of(ctl, prompt[:aligned])
    assert torch.equal(loaded.view(torch.int16), computed.view(torch.int16))
    # and the stored blocks are exactly that KV in the canonical layout
    store = connect(url)
    ns = llm.kv_namespace(16)
    blocks = store.load(ns, prefix_hashes(ns, prompt[:aligned]))
    assert torch.equal(torch.cat(blocks, dim=2).view(torch.int16), computed.view(torch.int16))
    store.close()
    # greedy output equals the control that splits the prefill at the same point (local prefix cache)
    split, _ = engine(None)
    split.generate([prompt[:aligned]], SamplingParams(max_tokens=1))
    ctl_out = split.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert ctl_out.num_local_cached_tokens == aligned
    assert warm.token_ids == ctl_out.token_ids == cold["token_ids"]


def test_fp32_warm_equals_no_connector_and_corruption_is_recomputed(tmp_path):
    url = f"local://{tmp_path}/store"
    args = ("--model", "tiny-random", "--prompt", TEXT, "--dtype", "float32", "--max-tokens", "16")
    # no connector at all, then cold and warm through the cache: one answer
    none = cli(*args, "--kv-connector", "none")
    cold = cli(*args, "--kv-connector", url)
    warm = cli(*args, "--kv-connector", url)
    assert warm["cached_tokens"] == (warm["prompt_tokens"] - 1) // 16 * 16 > 0
    assert none["token_ids"] == cold["token_ids"] == warm["token_ids"]
    # flip a bit in the third block's file: it is detected, the rest recomputed, same answer
    llm, conn = engine(url, dtype="float32")
    ns = llm.kv_namespace(16)
    prompt = llm.apply_chat_template([{"role": "user", "content": TEXT}])
    third = prefix_hashes(ns, prompt)[2]
    place = conn.client.tiers[1].location_of(third)
    conn.close()
    data = bytearray(read_at(place))
    data[-7] ^= 0x20
    write_at(place, bytes(data))
    after = cli(*args, "--kv-connector", url)
    assert after["cached_tokens"] == 2 * 16
    assert after["token_ids"] == none["token_ids"]


def test_blocks_the_store_lost_are_stored_again_once_recomputed(tmp_path):
    # a connector remembers what it stored, to skip it; a block the store evicted must not stay "stored"
    client = connect(f"local://{tmp_path}/store?cpu=300KiB&disk=600KiB")
    llm = LLM("tiny-random", dtype="float32", num_pages=64, enable_prefix_caching=False)
    llm.set_kv_connector(EngineConnector(client, llm.kv_namespace(16), llm.page_size))
    once = SamplingParams(max_tokens=2, ignore_eos=True)
    a = list(range(100, 181))  # five full blocks
    assert [llm.generate([a], once)[0].num_cached_tokens for _ in range(2)] == [0, 80]
    # other prompts push a's blocks out of both tiers: the next run is a miss and recomputes them
    for i in range(12):
        llm.generate([[(7 * i + 13 * j) % 1000 + 3 for j in range(81)]], once)
    client.flush(10)
    assert llm.generate([a], once)[0].num_cached_tokens == 0
    # which stored them again: the run after loads all five
    client.flush(10)
    assert llm.generate([a], once)[0].num_cached_tokens == 80
    client.close()


def test_a_save_that_cannot_gather_its_pages_costs_a_miss_not_the_batch(tmp_path, monkeypatch):
    import connectors.engine as engine_connector

    llm, conn = engine(f"local://{tmp_path}/store", dtype="float32")
    once = SamplingParams(max_tokens=2, ignore_eos=True)

    def broken(*a, **kw):
        raise RuntimeError("gather failed")
    # Reading the pages for an offload fails (a kernel error, memory): the requests still get their answers.
    monkeypatch.setattr(engine_connector, "gather_blocks", broken)
    outs = llm.generate([list(range(100, 181)), list(range(300, 381))], once)
    assert [len(o.token_ids) for o in outs] == [2, 2] and conn.stats.errors >= 1 and conn.stats.blocks_saved == 0
    conn.close()


class _Deadline(grpc.RpcError):
    """A call the daemon did not answer in time."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


def test_a_failed_daemon_lookup_does_not_resend_what_the_daemon_holds(tmp_path):
    # a daemon's client answers a failed call as a miss: the connector must not take it for blocks lost
    from tests.integration.daemon_process import DaemonProcess

    d = DaemonProcess(tmp_path, f'[tiers.cpu]\ncapacity = "64MiB"\n\n[tiers.disk]\npath = "{tmp_path / "store"}"\n'
                                'capacity = "256MiB"\n').start()
    try:
        client = connect(d.url("stream"))
        llm = LLM("tiny-random", dtype="float32", num_pages=64, enable_prefix_caching=False)
        conn = EngineConnector(client, llm.kv_namespace(16), llm.page_size)
        llm.set_kv_connector(conn)
        once, a = SamplingParams(max_tokens=2, ignore_eos=True), list(range(100, 181))
        assert llm.generate([a], once)[0].num_cached_tokens == 0 and conn.stats.blocks_saved == 5
        # one Lookup fails (the daemon busy): a miss, recomputed, and nothing sent again
        real = client.call

        def one_failure(name, request, timeout_s=None):
            client.call = real
            if name == "Lookup":
                raise _Deadline()
            return real(name, request, timeout_s)
        client.call = one_failure
        assert llm.generate([a], once)[0].num_cached_tokens == 0 and client.errors == 1
        assert conn.stats.blocks_saved == 5
        client.close()
    finally:
        d.stop()


def test_unreachable_or_malformed_cache_urls(tmp_path):
    # a daemon that does not answer: a warning, an answer without the cache, exit 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "tiny-random", "--prompt", "hi",
                         "--max-tokens", "2", "--kv-connector", "grpc://127.0.0.1:9"],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert ok.returncode == 0 and "without the KV cache" in ok.stderr
    # a malformed URL (another scheme, no scheme at all, a port that is no port) is a one-line error
    # naming the accepted forms and a non-zero exit, and creates nothing
    for url, says in (("ftp://x", "expected local:///"), ("local", "expected local:///"),
                      ("grpc://127.0.0.1:notaport", "port 1-65535"), ("grpc://127.0.0.1:99999", "port 1-65535")):
        bad = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "tiny-random", "--prompt",
                              "hi", "--kv-connector", url], capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=300)
        assert bad.returncode == 2 and bad.stderr.strip().startswith("tierkv: error:") and says in bad.stderr, url
        assert "Traceback" not in bad.stderr and list(tmp_path.iterdir()) == [], url
    # store blocks that are no whole number of the engine's pages: the same one-line error (it was a traceback)
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "tiny-random", "--prompt", "hi",
                          "--kv-connector", f"local://{tmp_path}/c", "--block-tokens", "7"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert bad.returncode == 2 and "page size" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_smollm2_warm_matches_split_control_in_bf16_and_no_connector_in_fp32(tmp_path):
    # the real model: a store filled by one engine, read by a fresh engine and a fresh store
    question = "Summarize in one sentence: " + TEXT
    for dtype in ("bfloat16", "float32"):
        url = f"local://{tmp_path}/{dtype}"
        first, conn = engine_for("smollm2", url, dtype)
        prompt = first.apply_chat_template([{"role": "user", "content": question}])
        cold = first.generate([prompt], SamplingParams(max_tokens=10))[0]
        conn.close()
        second, conn = engine_for("smollm2", url, dtype)
        warm = second.generate([prompt], SamplingParams(max_tokens=10))[0]
        conn.close()
        aligned = (len(prompt) - 1) // 16 * 16
        assert warm.num_cached_tokens == aligned
        if dtype == "bfloat16":
            # same split without the service: the engine's own prefix cache
            split, _ = engine_for("smollm2", None, dtype)
            split.generate([prompt[:aligned]], SamplingParams(max_tokens=1))
            assert split.generate([prompt], SamplingParams(max_tokens=10))[0].token_ids == warm.token_ids
        else:
            # in fp32 the split does not change rounding: identical to no connector at all
            assert warm.token_ids == cold.token_ids


def engine_for(model: str, url: str | None, dtype: str) -> tuple[LLM, EngineConnector | None]:
    llm = LLM(model, dtype=dtype, kv_cache_bytes=256 << 20)
    conn = None
    if url:
        conn = EngineConnector(connect(url), llm.kv_namespace(16), llm.page_size)
        llm.set_kv_connector(conn)
    return llm, conn
