"""The vLLM connector's vLLM-free parts: extra config, scheduler planning,
lookups across processes, and the worker's page <-> block copies against a
real embedded store and caches laid out like vLLM's (checked by the oracle).
"""
from __future__ import annotations

import threading

import pytest
import torch

from cache_service.blocks.keys import Namespace, prefix_hashes
from connectors.client import connect
from connectors.vllm.lookup import LookupServer, RemoteLookup, lookup_address
from connectors.vllm.scheduler import SchedulerSide, TierKVConfig, Transfer
from connectors.vllm.pages import CpuPageLayout, as_rows
from connectors.vllm.worker import WorkerSide
from tests.connectors.vllm.oracle import blocks_as_tokens, cpu_index, read_tokens, same, tokens
from tiers.types import ConfigError, TierUnavailableError

NS = Namespace("unit-model", "bfloat16", num_layers=2, kv_heads=2, head_dim=8, block_tokens=16)


@pytest.fixture
def client(tmp_path):
    c = connect(f"local://{tmp_path}/store")
    yield c
    c.close()


def fill(client, ids: list[int], n_blocks: int) -> None:
    """Store the first n_blocks blocks of `ids` with random payloads."""
    hs = prefix_hashes(NS, ids)[:n_blocks]
    client.store(NS, hs, [torch.randn(NS.block_shape).to(torch.bfloat16) for _ in hs])


# ------------------------------------------------------------- config


def test_extra_config_errors_name_the_key():
    # an unknown key, then a bad value of each key, are refused with its name
    with pytest.raises(ConfigError, match="block_tokns"):
        TierKVConfig.from_extra({"url": "local:///x", "block_tokns": 16})
    for key, bad in [("block_tokens", 0), ("block_tokens", "16"), ("url", ""), ("tenant", 3), ("load_failure", "x"),
                     ("async_save", "yes"), ("async_save", 1)]:
        with pytest.raises(ConfigError, match=key):
            TierKVConfig.from_extra({key: bad})
    assert TierKVConfig.from_extra(None) == TierKVConfig()


# ------------------------------------------------------------- scheduler side


def test_lookup_claims_whole_blocks_from_a_page_and_never_the_whole_prompt(client):
    sched = SchedulerSide(client, NS, page_tokens=128)
    x = tokens(700, 1)
    # nothing stored: nothing claimed
    assert sched.matched_tokens("a", x, 0, "") == 0
    # 20 blocks (320 tokens) stored: all claimed, two whole pages and half of the third
    fill(client, x, 20)
    assert sched.matched_tokens("a", x, 0, "") == 320
    # everything stored: every full block before the final token; asking twice changes nothing
    fill(client, x, 43)
    assert sched.matched_tokens("a", x, 0, "") == 688
    assert sched.matched_tokens("a", x, 0, "") == 688
    # vLLM's own prefix cache already has a page: only the rest is claimed
    assert sched.matched_tokens("a", x, 128, "") == 560
    # a prompt that is exactly pages long keeps its last block for vLLM to compute
    assert sched.matched_tokens("b", x[:640], 0, "") == 624
    # another tenant sees nothing
    assert sched.matched_tokens("c", x, 0, "acme") == 0


def test_plan_loads_after_alloc_then_saves_each_new_full_block(client):
    sched = SchedulerSide(client, NS, page_tokens=128)
    x = tokens(700, 2)
    fill(client, x, 20)
    pages = list(range(100, 106))
    # vLLM accepts the 320 claimed tokens and allocates pages
    assert sched.matched_tokens("r", x, 0, "") == 320
    sched.allocated("r", pages, 320)
    # step 1 (a prefill chunk up to token 400): load [0, 320), the third page in part; save the blocks after it
    loads, saves = sched.plan([("r", 320, 80)], lambda _: pages)
    assert [(t.start, t.end, t.page_ids) for t in loads] == [(0, 320, [100, 101, 102])]
    assert [(t.start, t.end, t.page_ids) for t in saves] == [(320, 400, [102, 103])]
    # step 2: the rest of the prompt; blocks from 400 on are saved, from the page holding token 400
    loads, saves = sched.plan([("r", 400, 300)], lambda _: pages)
    assert loads == [] and [(t.start, t.end, t.page_ids) for t in saves] == [(400, 688, [103, 104, 105])]
    assert saves[0].token_ids == x[:688]
    # decode reaches the next block boundary: one block saved
    x.extend(tokens(16, 3))
    assert sched.plan([("r", 700, 1)], lambda _: pages) == ([], [])
    _, saves = sched.plan([("r", 703, 1)], lambda _: pages)
    assert [(t.start, t.end, t.page_ids) for t in saves] == [(688, 704, [105])]
    # a worker reports that only 128 tokens loaded: those after are saved again once recomputed
    sched.load_failed("r", 128, sched.step)
    _, saves = sched.plan([("r", 704, 1)], lambda _: pages)
    assert [(t.start, t.end) for t in saves] == [(128, 704)]
    # a request with saves planned is reported as saving (vLLM waits for the workers); one without is not
    assert sched.finished("r") is True
    assert sched.plan([("r", 705, 1)], lambda _: pages) == ([], [])
    assert sched.matched_tokens("q", x[:100], 0, "") == 96  # its first 6 blocks, the first page in part
    assert sched.finished("q") is False


def test_scheduler_in_another_process_looks_up_through_the_worker(tmp_path):
    # the worker owns the embedded store and serves lookups; a second open of the directory is refused
    url = f"local://{tmp_path}/store"
    store = connect(url)
    server = LookupServer(store, lookup_address(url, "i"))
    try:
        with pytest.raises(TierUnavailableError):
            connect(url)
        x = tokens(700, 9)
        fill(store, x, 20)
        remote = RemoteLookup(lookup_address(url, "i"))
        # the remote view answers exactly what the store answers, and plans the same loads
        hs = prefix_hashes(NS, x)
        assert remote.lookup(hs) == store.lookup(hs) == 20
        assert SchedulerSide(remote, NS, 128).matched_tokens("r", x, 0, "") == 320
        remote.close()
    finally:
        server.close()
        store.close()
    # no owner any more: a lookup is a miss, not an error
    assert RemoteLookup(lookup_address(url, "i"), timeout_s=1).lookup(hs) == 0


# ------------------------------------------------------------- worker side


def vllm_cache(layout: str, pages: int, page: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-layer caches shaped like vLLM's, as views of one buffer (as vLLM allocates them)."""
    g = torch.Generator().manual_seed(seed)
    shape = (pages, NS.kv_heads, page, 2 * NS.head_dim) if layout == "cpu" else \
        (2, pages, page, NS.kv_heads, NS.head_dim)
    n = torch.Size(shape).numel()
    buf = torch.randn(NS.num_layers * n, generator=g).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buf[i * n:(i + 1) * n].view(shape) for i in range(NS.num_layers)}


def test_cpu_page_layout_recognizes_packings():
    # token-major and K-transposed packings get fast paths; anything else is a permutation
    assert CpuPageLayout(cpu_index("tokens", 128, 8)).kind == "tokens"
    assert CpuPageLayout(cpu_index("k_transposed", 128, 8)).kind == "k_transposed"
    assert CpuPageLayout(cpu_index("permuted", 16, 8)).kind == "permuted"
    # an index that drops an element is refused
    bad = cpu_index("tokens", 16, 8)
    bad[1, 0, 0] = 0
    with pytest.raises(ConfigError, match="permutation"):
        CpuPageLayout(bad)


@pytest.mark.parametrize("layout,page,packing", [
    ("cpu", 128, "k_transposed"), ("cpu", 128, "tokens"), ("cpu", 16, "permuted"), ("cpu", 32, "k_transposed"),
    ("cpu", 8, "k_transposed"),
    ("flash", 16, None), ("flash", 32, None), ("flash", 8, None)])
@pytest.mark.parametrize("order", ["descending", "runs"])
def test_worker_saves_and_loads_through_the_store(client, layout, page, packing, order):
    x = tokens(300, 4)
    index = cpu_index(packing, page, NS.head_dim, seed=page) if packing else None
    packed = CpuPageLayout(index) if packing else None
    src = vllm_cache(layout, 48, page, seed=5)
    n_pages = -(-300 // page)
    src_pages = list(range(3, 3 + n_pages))
    worker = WorkerSide(client, NS, page)
    worker.register(src, packed)
    # two prefill chunks are saved: [0, 160) then [160, 288)
    worker.save([Transfer("r", x[:160], 0, 160, src_pages[: -(-160 // page)])])
    first = 160 // page
    worker.save([Transfer("r", x[:288], 160, 288, src_pages[first: -(-288 // page)])])
    layers = [src[k] for k in sorted(src)]
    # the store holds, in canonical order, exactly what the oracle reads from vLLM's pages
    stored = client.load(NS, prefix_hashes(NS, x[:288]))
    assert same(blocks_as_tokens(stored), read_tokens(layers, src_pages, 0, 0, 288, index))
    # a new cache (other pages) loads all 18 blocks, the last page in part where pages hold more than a
    # block, and reads back the same bits
    dst = vllm_cache(layout, 48, page, seed=6)
    end = 288
    # pages one by one going down, or stretches of consecutive pages (each written in place)
    dst_pages = list(range(40, 40 - -(-end // page), -1))
    if order == "runs":  # two stretches of consecutive pages, the second below the first
        half = len(dst_pages) // 2
        dst_pages = list(range(30, 30 + len(dst_pages) - half)) + list(range(10, 10 + half))
    fresh = WorkerSide(client, NS, page)
    fresh.register(dst, packed)
    fresh.load([Transfer("r", x[:end], 0, end, dst_pages)])
    assert fresh.failed == {} and fresh.take_invalid_pages() == set()
    got = read_tokens([dst[k] for k in sorted(dst)], dst_pages, 0, 0, end, index)
    assert same(got, read_tokens(layers, src_pages, 0, 0, end, index))
    assert fresh.stats.blocks_loaded == end // 16


def test_missing_block_ends_the_load_and_reports_pages(client):
    x = tokens(700, 7)
    fill(client, x, 40)
    # block 20 (tokens 320-335, page 2) disappears from the store
    client.delete(prefix_hashes(NS, x)[20:21])
    cache = vllm_cache("cpu", 16, 128, seed=8)
    worker = WorkerSide(client, NS, 128)
    worker.register(cache, CpuPageLayout(cpu_index("k_transposed", 128, NS.head_dim)))
    pages = [9, 8, 7, 6, 5]
    worker.load([Transfer("r", x[:640], 0, 640, pages)])
    # pages from the one holding the missing block on are reported; two pages were loaded
    assert worker.take_invalid_pages() == {7, 6, 5}
    assert worker.failed == {"r": 256}
    assert worker.stats.blocks_loaded == 16 and worker.stats.blocks_failed == 20
    # the same step's save of that request is skipped (its KV was computed on bad context)
    before = worker.stats.blocks_saved
    worker.save([Transfer("r", x[:700], 640, 688, [5])])
    assert worker.stats.blocks_saved == before
    assert worker.take_failed() == {"r": 256} and worker.failed == {}


class _SharedBuffer:
    """The real store, its loaded payloads handed out as the daemon's shared-memory
    path does: views spaced evenly in one buffer, a header's gap between them."""

    def __init__(self, client) -> None:
        self.client = client

    def load(self, ns, hashes):
        got = self.client.load(ns, hashes)
        gap = 64  # elements between payloads, as a 128-byte object header
        per = ns.payload_bytes // 2 + gap
        buf = torch.zeros(len(got) * per, dtype=torch.bfloat16)
        out = []
        for i, p in enumerate(got):
            view = buf[i * per + gap: (i + 1) * per].view(ns.block_shape)
            out.append(view.copy_(p) if p is not None else None)
        return out


@pytest.mark.parametrize("packing", ["k_transposed", "tokens", "permuted"])
def test_blocks_in_one_shared_buffer_load_the_same_bits(client, packing):
    x = tokens(512, 9)
    fill(client, x, 32)
    index = cpu_index(packing, 128, NS.head_dim, seed=3)
    # the evenly spaced views are read in place as one batch; a list of separate tensors is not
    spaced = _SharedBuffer(client).load(NS, prefix_hashes(NS, x))
    view, order = as_rows(spaced)
    assert order is None and torch.equal(view, torch.stack(spaced))
    assert as_rows(client.load(NS, prefix_hashes(NS, x))) is None
    # views in one buffer in any order (a pool's slots) are rows of one view, gathered by index
    view, order = as_rows(spaced[::-1][:5])
    assert torch.equal(view.index_select(0, order), torch.stack(spaced[::-1][:5]))
    # loading from either gives the same pages, bit for bit
    caches = []
    for source in (client, _SharedBuffer(client)):
        cache = vllm_cache("cpu", 8, 128, seed=1)
        worker = WorkerSide(source, NS, 128)
        worker.register(cache, CpuPageLayout(index))
        worker.load([Transfer("r", x, 0, 512, [6, 2, 4, 1])])
        assert worker.failed == {}
        caches.append(read_tokens([cache[k] for k in sorted(cache)], [6, 2, 4, 1], 0, 0, 512, index))
    assert same(caches[0], caches[1])


# ------------------------------------------------------------- asynchronous saves


class _Gate:
    """The store behind a gate: `store` blocks until the test opens it."""

    def __init__(self, client) -> None:
        self.client, self.open = client, threading.Event()
        self.load = client.load

    def store(self, ns, hashes, payloads):
        assert self.open.wait(30), "the test never opened the gate"
        return self.client.store(ns, hashes, payloads)


def test_async_saves_hold_a_finished_request_until_its_pages_are_read(client):
    x = tokens(300, 11)
    index = cpu_index("k_transposed", 128, NS.head_dim)
    src = vllm_cache("cpu", 8, 128, seed=12)
    gate = _Gate(client)
    worker = WorkerSide(gate, NS, 128, async_save=True)
    worker.register(src, CpuPageLayout(index))
    # the step queues its saves and returns at once, while the store is still closed
    worker.save([Transfer("r", x[:288], 0, 288, [5, 2, 7]), Transfer("s", x[:128], 0, 128, [1])])
    assert worker.stats.blocks_saved == 0 and worker.stats.save_wait_s < 5
    # vLLM finishes "r": it is not reported while its saves have not read its pages
    assert worker.saves.finished({"r"}) == set()
    assert not worker.saves.wait(["r"], timeout_s=0.05)
    # the gate opens: the saves run, and "r" is reported once (a later poll does not repeat it)
    gate.open.set()
    assert worker.saves.wait(["r"], timeout_s=30)
    assert worker.saves.finished(set()) == {"r"}
    assert worker.saves.finished({"r"}) == set()
    # what the store holds is exactly what vLLM's pages held
    stored = client.load(NS, prefix_hashes(NS, x[:288]))
    assert same(blocks_as_tokens(stored), read_tokens([src[k] for k in sorted(src)], [5, 2, 7], 0, 0, 288, index))
    # closing finishes every queued save ("s" was never finished by vLLM: it stays unreported)
    assert worker.saves.close(timeout_s=30)
    assert worker.stats.blocks_saved == 18 + 8 and worker.saves.finished(set()) == set()


def test_async_save_of_a_request_whose_load_failed_is_skipped_but_reported(client):
    x = tokens(700, 13)
    fill(client, x, 40)
    client.delete(prefix_hashes(NS, x)[20:21])
    worker = WorkerSide(client, NS, 128, async_save=True)
    worker.register(vllm_cache("cpu", 16, 128, seed=8), CpuPageLayout(cpu_index("k_transposed", 128, NS.head_dim)))
    # the load stops short, so the same step's save is dropped, not queued
    worker.load([Transfer("r", x[:640], 0, 640, [9, 8, 7, 6, 5])])
    worker.save([Transfer("r", x[:700], 640, 688, [5])])
    assert worker.saves.wait(timeout_s=30) and worker.stats.blocks_saved == 0
    # the scheduler planned a save for it, so vLLM waits for it: it is reported when finished
    assert worker.saves.finished({"r", "never-saved"}) == {"r"}
    worker.saves.close()


# ------------------------------------------------------------------ session hints
def test_session_hints_of_vllm_requests_pin_release_and_prefetch(tmp_path):
    from cache_service.sessions.manifests import SessionStore
    from connectors.prefix import full_blocks
    from connectors.vllm.hints import VllmSessionHints
    from tests.cache_service.store.store_helpers import NS, make_store, payload_for

    store = make_store(tmp_path, cpu_blocks=64)
    hints = VllmSessionHints(store, lambda tenant: NS, SessionStore(tmp_path / "m"))
    tokens = list(range(5 * NS.block_tokens))
    keys = full_blocks(NS, tokens)
    store.store(NS, keys, [payload_for(k) for k in keys])
    retain = {"tierkv": {"session": "agent-7", "retain_s": 600}}

    # A finished request with a retain hint pins its computed tokens' blocks and records the session.
    hints.finished(retain, "", tokens)
    hints.drain()
    assert store.pins.session_pins("") == {"agent-7": 5}
    assert hints.manifests.get("agent-7").token_ids == tokens
    # A prefetch hint on arrival promotes the recorded session (already on top here: nothing to queue).
    hints.arrived({"tierkv": {"session": "agent-7", "prefetch": True}}, "")
    hints.drain()
    # Malformed hints are logged and counted; requests without hints do nothing.
    hints.finished({"tierkv": {"session": "agent-7", "retain_s": "long"}}, "", tokens)
    hints.finished({"other": 1}, "", tokens)
    assert hints.errors == 1
    # Release lets the pin go.
    hints.finished({"tierkv": {"session": "agent-7", "release": True}}, "", [])
    hints.close()
    assert store.pins.session_pins("") == {} and hints.applied == 3
    store.close()
