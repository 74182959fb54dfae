"""A load that fails on the worker: nothing computed while its invalid pages
may have been read is saved (the store keeps a block's first copy, so the
recomputed KV could never replace it), whatever the order vLLM calls us in:
the failing step itself, a request sharing the failed pages, the next chunk
planned before the failure was reported (async scheduling), and the save
that speculative decoding defers past the failure report. The scheduler
side and worker side are driven as vLLM drives them, against a real
embedded store."""
from __future__ import annotations

import pytest
import torch

from cache_service.blocks.keys import Namespace, prefix_hashes
from connectors.client import connect
from connectors.vllm.pages import CpuPageLayout
from connectors.vllm.scheduler import SchedulerSide, Transfer
from connectors.vllm.worker import WorkerSide
from tests.connectors.vllm.oracle import cpu_index, tokens
from tests.connectors.vllm.test_vllm_sides import NS, vllm_cache

PAGE = 16
BAD = 99.0  # what a forward over invalid pages "computes" here


@pytest.fixture
def client(tmp_path):
    c = connect(f"local://{tmp_path}/store")
    yield c
    c.close()


def stored_blocks(client, x, n: int) -> None:
    hs = prefix_hashes(NS, x)[:n]
    client.store(NS, hs, [torch.randn(NS.block_shape).to(torch.bfloat16) for _ in hs])


def compute(cache, pages, value: float) -> None:
    """The forward writes KV of `value` into vLLM's pages (flash layout: [2, pages, page, heads, dim])."""
    for layer in cache.values():
        layer[:, pages] = value


def bad_in_store(client, x, first: int, last: int) -> bool:
    got = client.load(NS, prefix_hashes(NS, x)[first:last])
    return any(g is not None and bool((g == BAD).all()) for g in got)


def flash_worker(client, pages: int) -> tuple[WorkerSide, dict]:
    """A worker side over vLLM flash-layout caches of `pages` pages: (worker, caches)."""
    cache = vllm_cache("flash", pages, PAGE, 7)
    w = WorkerSide(client, NS, PAGE)
    w.register(cache)
    return w, cache


def test_the_next_chunk_planned_before_the_failure_was_reported_is_not_saved(client):
    x = tokens(400, 3)
    stored_blocks(client, x, 4)
    sched, pages = SchedulerSide(client, NS, PAGE), list(range(25))
    sched.allocated("A", pages, sched.matched_tokens("A", x, 0, ""))
    # Async scheduling: step N (load [0, 64), compute [64, 96)) and N+1 (compute [96, 160)) are both planned.
    loads_n, saves_n = sched.plan([("A", 64, 32)], lambda r: pages)
    n, heard_n = sched.step, sched.heard
    _, saves_n1 = sched.plan([("A", 96, 64)], lambda r: pages)
    heard_n1 = sched.heard
    # Block 2 is gone when step N loads: N fails, and N+1 computes on the invalid pages.
    client.delete(prefix_hashes(NS, x)[2:3])
    w, cache = flash_worker(client, 32)
    w.load(loads_n, n)
    w.save(saves_n, heard_n)
    failed = w.take_failed()
    assert failed == {"A": 32}
    compute(cache, list(range(6, 10)), BAD)
    w.save(saves_n1, heard_n1)
    # N's report reaches the scheduler; vLLM recomputes from token 32 and the re-planned saves land.
    for req, good in failed.items():
        sched.load_failed(req, good, w.failed_step)
    compute(cache, list(range(2, 10)), 1.0)
    _, again = sched.plan([("A", 32, 128)], lambda r: pages)
    w.save(again, sched.heard)
    assert not bad_in_store(client, x, 2, 10) and w.stats.blocks_unsaved == 2 + 4
    assert all(g is not None for g in client.load(NS, prefix_hashes(NS, x)[2:10]))


def test_a_request_sharing_the_failed_pages_in_the_same_step_is_not_saved(client):
    x = tokens(100, 3)
    xb = x[:64] + tokens(36, 4)  # B shares A's first 64 tokens, through vLLM's prefix cache
    stored_blocks(client, x, 4)
    sched = SchedulerSide(client, NS, PAGE)
    a_pages, b_pages = [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 10, 11, 12]
    sched.allocated("A", a_pages, sched.matched_tokens("A", x, 0, ""))
    assert sched.matched_tokens("B", xb, 64, "") == 0
    loads, saves = sched.plan([("A", 64, 36), ("B", 64, 36)], {"A": a_pages, "B": b_pages}.__getitem__)
    client.delete(prefix_hashes(NS, x)[2:3])
    w, cache = flash_worker(client, 16)
    w.load(loads, sched.step)
    compute(cache, [4, 5, 10, 11], BAD)  # both attend to the invalid pages 2 and 3
    w.save(saves, sched.heard)
    # Neither A's nor B's new blocks reach the store.
    assert w.take_failed() == {"A": 32}
    assert client.lookup(prefix_hashes(NS, xb)[4:6]) == 0 and not bad_in_store(client, x, 4, 6)


def test_a_save_deferred_past_the_failure_report_is_not_saved(client):
    # Speculative decoding: vLLM builds the worker's report (take_failed) before it calls wait_for_save.
    x = tokens(100, 3)
    stored_blocks(client, x, 4)
    sched, pages = SchedulerSide(client, NS, PAGE), list(range(7))
    sched.allocated("A", pages, sched.matched_tokens("A", x, 0, ""))
    loads, saves = sched.plan([("A", 64, 36)], lambda r: pages)
    client.delete(prefix_hashes(NS, x)[2:3])
    w, cache = flash_worker(client, 8)
    w.load(loads, sched.step)
    compute(cache, [4, 5], BAD)
    assert w.take_invalid_pages() and w.take_failed() == {"A": 32}
    w.save(saves, sched.heard)
    assert w.stats.blocks_saved == 0 and not bad_in_store(client, x, 4, 6)


def test_an_earlier_failures_report_does_not_clear_a_later_failure_under_async_scheduling(client):
    x, y = tokens(400, 3), tokens(400, 4)  # two unrelated prompts, 4 blocks of each in the store
    stored_blocks(client, x, 4)
    stored_blocks(client, y, 4)
    sched, px, py = SchedulerSide(client, NS, PAGE), list(range(25)), list(range(25, 50))
    # Step N-1 loads X; step N, planned before N-1's output came back (async scheduling), loads Y.
    sched.allocated("X", px, sched.matched_tokens("X", x, 0, ""))
    loads_x, saves_x = sched.plan([("X", 64, 32)], lambda r: px)
    step_x, heard_x = sched.step, sched.heard
    sched.allocated("Y", py, sched.matched_tokens("Y", y, 0, ""))
    loads_y, saves_y = sched.plan([("Y", 64, 32)], lambda r: py)
    step_y, heard_y = sched.step, sched.heard
    # Block 2 of each is gone when its step loads: both loads fail.
    client.delete(prefix_hashes(NS, x)[2:3] + prefix_hashes(NS, y)[2:3])
    w, cache = flash_worker(client, 50)
    w.load(loads_x, step_x)
    w.save(saves_x, heard_x)
    report_x = (w.take_failed(), w.failed_step)
    # The scheduler hears of X's failure, then plans N+1 (Y's next chunk) before N's report.
    sched.load_failed("X", report_x[0]["X"], report_x[1])
    w.load(loads_y, step_y)
    w.save(saves_y, heard_y)
    assert w.take_failed() == {"Y": 32}
    _, saves_n1 = sched.plan([("Y", 96, 64)], lambda r: py)
    compute(cache, list(range(25 + 6, 25 + 10)), BAD)  # Y's chunk, computed over Y's invalid pages
    w.save(saves_n1, sched.heard)
    # Nothing computed on Y's invalid pages reaches the store.
    assert not bad_in_store(client, y, 6, 10) and w.stats.blocks_saved == 0


def test_store_blocks_larger_than_pages_never_load_from_inside_a_block(client):
    # block_tokens 256 over vLLM's 128-token CPU pages; vLLM's own hit is one page, inside the first block.
    ns = Namespace("unit-model", "bfloat16", num_layers=2, kv_heads=2, head_dim=8, block_tokens=256)
    x = tokens(600, 1)
    hs = prefix_hashes(ns, x)[:2]
    client.store(ns, hs, [torch.randn(ns.block_shape).to(torch.bfloat16) for _ in hs])
    sched = SchedulerSide(client, ns, 128)
    # Loading from token 128 would need half a block: nothing is claimed, vLLM computes.
    assert sched.matched_tokens("b", x, 128, "") == 0
    # From a block's start, the blocks are claimed as before.
    assert sched.matched_tokens("c", x, 0, "") == 512


def test_a_load_whose_pages_cannot_be_written_is_a_failed_load_not_a_crash(client):
    x = tokens(300, 5)
    stored_blocks(client, x, 8)
    w = WorkerSide(client, NS, 128)
    w.register(vllm_cache("cpu", 4, 128, seed=2), CpuPageLayout(cpu_index("k_transposed", 128, NS.head_dim)))
    # A transfer with fewer pages than its blocks need (a planning bug, say): reported, recomputed.
    w.load([Transfer("r", x[:128], 0, 128, [])], 0)
    assert w.take_failed() == {"r": 0} and w.stats.errors == 1


# ------------------------------------------------------------------ namespaces
def _vllm(model: str, layers=range(4), pp: int = 1, quant=None, **spec_extra):
    """(vllm_config, kv_cache_config) shaped as vLLM hands them to the connector."""
    from types import SimpleNamespace as S
    spec = S(head_size=8, num_kv_heads=2, dtype=torch.bfloat16, block_size=16, **spec_extra)
    kvc = S(kv_cache_groups=[S(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.self_attn.attn" for i in layers])])
    vc = S(model_config=S(model=model, revision=None, quantization=quant, hf_overrides=None),
           parallel_config=S(tensor_parallel_size=1, pipeline_parallel_size=pp))
    return vc, kvc


def test_instances_whose_kv_differs_never_share_a_namespace(tmp_path):
    from connectors.vllm.namespace import build_namespace
    from connectors.vllm.scheduler import TierKVConfig
    from tiers.types import ConfigError

    def fingerprint(vc_kvc) -> bytes:
        return build_namespace(*vc_kvc, TierKVConfig(), 0)[0].fingerprint()

    # Pipeline stages with as many layers each: different layers, different blocks.
    assert fingerprint(_vllm("org/m", range(0, 4), pp=2)) != fingerprint(_vllm("org/m", range(4, 8), pp=2))
    # Online quantization of the same checkpoint.
    assert fingerprint(_vllm("org/m")) != fingerprint(_vllm("org/m", quant="fp8"))
    # The common case keeps the id our own engine derives (no suffix).
    assert build_namespace(*_vllm("org/m"), TierKVConfig(), 0)[0].model_id == "org/m"
    # Two PyTorch-format checkpoints alike but for their weights.
    for name, weights in (("a", b"\x01" * 64), ("b", b"\x02" * 64)):
        d = tmp_path / name / "llama"
        d.mkdir(parents=True)
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "pytorch_model.bin").write_bytes(weights)
    assert fingerprint(_vllm(str(tmp_path / "a" / "llama"))) != fingerprint(_vllm(str(tmp_path / "b" / "llama")))
    # A directory with no weights cannot be told apart: refused.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no weights"):
        fingerprint(_vllm(str(tmp_path / "empty")))
    # Sliding-window and chunked local attention (vLLM's null block stands in for pages) are refused.
    for extra in ({"sliding_window": 64}, {"attention_chunk_size": 256}):
        with pytest.raises(ConfigError, match="sliding-window"):
            fingerprint(_vllm("org/m", **extra))


def _tp_rank(rank: int, root: str, out) -> None:
    """One of two TP ranks (a process of its own, gloo): its own store and namespace, the same plan."""
    import dataclasses

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    ns = dataclasses.replace(NS, tp_rank=rank, tp_world=2)
    client = connect(f"local://{root}/store-{rank}")
    x = tokens(400, 3)
    hs = prefix_hashes(ns, x)[:4]
    client.store(ns, hs, [torch.randn(ns.block_shape).to(torch.bfloat16) for _ in hs])
    sched, pages = SchedulerSide(client, ns, PAGE), list(range(12))
    sched.allocated("A", pages, sched.matched_tokens("A", x, 0, ""))
    # Step N loads [0, 64) and computes [64, 72): under a block, so it saves nothing (no save call, no
    # agreement in it). Step N+1, planned before N's report (async scheduling), computes [72, 160).
    loads, saves = sched.plan([("A", 64, 8)], lambda r: pages)
    step_n = sched.step
    _, saves_n1 = sched.plan([("A", 72, 88)], lambda r: pages)
    assert not saves and saves_n1
    if rank == 1:
        client.delete(hs[2:3])  # this rank's copy of block 2 is gone before the load: only its load fails
    cache = vllm_cache("flash", 16, PAGE, 7)
    w = WorkerSide(client, ns, PAGE, ranks=dist.group.WORLD)
    w.register(cache)
    w.load(loads, step_n)
    compute(cache, list(range(4, 10)), BAD)  # the forward's all-reduces mix rank 1's invalid pages into every rank's KV
    w.save(saves_n1, sched.heard)
    out.put((rank, w.stats.blocks_saved, w.take_failed()))
    client.close()
    dist.destroy_process_group()


def test_a_load_failed_on_one_tensor_parallel_rank_taints_every_rank(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    # Rank 1's load failed (and it reports it); rank 0's succeeded, yet neither saved the step's KV.
    assert got == [(0, 0, {}), (1, 0, {"A": 32})]
