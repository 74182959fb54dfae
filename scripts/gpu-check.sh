#!/usr/bin/env bash
# The CUDA paths on a lent GPU machine (torch + triton there; no lmdb/redis/boto3 needed):
# the HBM tier, the Triton kernels compiled for the GPU against their torch references (the masked
# and the unmasked variant, one and several pages per block, from the main thread and another),
# vLLM's CUDA (flash-attention) layout adapter, each bit for bit, and serve-engine's logit adjustments
# on CUDA logits against the CPU's. A section that raises is
# recorded as its error, not a traceback. Last line: one JSON object.
set -uo pipefail
cd "$(dirname "$0")/.."
exec python3 - <<'PY'
import json, sys, threading, time, traceback
import torch
sys.path.insert(0, ".")
out = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
if not out["cuda"]:
    print(json.dumps(out)); sys.exit(1)
out["gpu"] = torch.cuda.get_device_name(0)
import triton
out["triton"] = triton.__version__
from kernels import gather_blocks, scatter_blocks
from kernels.paged_copy_ref import gather_blocks_ref
from kernels.layouts import gather_vllm_flash, scatter_vllm_flash, gather_vllm_flash_ref
from tiers.hbm import HbmTier
dev, g = torch.device("cuda", 0), torch.Generator(device="cuda").manual_seed(0)

def section(name, fn):
    try:
        fn()
    except Exception as e:  # the JSON line still comes, naming what failed
        out[f"{name}_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()

def same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

def timed(fn, reps=20):
    fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / reps

def in_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn())); t.start(); t.join()
    return box[0]

def paged(tag, L, P, page, H, D, ppb):
    """Our engine's cache: gather vs the reference; scatter writes the mapped pages and no other."""
    cache = torch.randn(L, 2, P, page, H, D, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.randperm(P, device=dev)[:120 // ppb * ppb].view(-1, ppb)
    tri = gather_blocks(cache, ids, impl="triton")
    ref = gather_blocks_ref(cache, ids, torch.empty_like(tri))
    out[f"{tag}_gather_same"] = same(tri, ref)
    out[f"{tag}_gather_thread_same"] = same(in_thread(lambda: gather_blocks(cache, ids, impl="triton")), ref)
    back = torch.randn_like(cache, dtype=torch.float32).to(torch.bfloat16)
    before = back.clone()
    scatter_blocks(tri, ids, back, impl="triton")
    torch.cuda.synchronize()
    unmapped = torch.ones(P, dtype=torch.bool, device=dev)
    unmapped[ids.reshape(-1)] = False
    out[f"{tag}_scatter_same"] = same(gather_blocks(back, ids, impl="torch"), ref) and \
        same(back[:, :, unmapped], before[:, :, unmapped])
    nbytes = tri.numel() * 2
    out[f"{tag}_gather_gbs"] = round(nbytes / timed(lambda: gather_blocks(cache, ids, out=tri, impl="triton")) / 1e9, 1)
    out[f"{tag}_gather_torch_gbs"] = round(nbytes / timed(lambda: gather_blocks(cache, ids, out=tri, impl="torch")) / 1e9, 1)

# 1. SmolLM2's pages (3,072 elements: the masked tail), Llama-8B's (16 x 8 x 128: unmasked), 2 pages per block
section("paged", lambda: paged("paged", 30, 256, 16, 3, 64, 1))
section("paged_even", lambda: paged("paged_even", 4, 256, 16, 8, 128, 1))
section("paged_ppb2", lambda: paged("paged_ppb2", 4, 256, 16, 8, 128, 2))

def flash():
    """vLLM's CUDA layout: per layer [2, pages, page, H, D] (flash-attention)."""
    L, P, page, H, D = 30, 256, 16, 3, 64
    ids = torch.randperm(P, device=dev)[:120].view(-1, 1)
    layers = [torch.randn(2, P, page, H, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(L)]
    fl = gather_vllm_flash(layers, ids, impl="triton")
    out["flash_gather_same"] = same(fl, gather_vllm_flash_ref(layers, ids, torch.empty_like(fl)))
    dst = [torch.zeros_like(x) for x in layers]
    scatter_vllm_flash(fl, ids, dst, impl="triton")
    out["flash_scatter_same"] = same(gather_vllm_flash(dst, ids, impl="torch"), fl)
    out["flash_gather_gbs"] = round(fl.numel() * 2 / timed(lambda: gather_vllm_flash(layers, ids, out=fl, impl="triton")) / 1e9, 1)

section("flash", flash)

def hbm():
    """The HBM tier: objects in device slots, read back to the GPU (from another thread too) and into pinned buffers."""
    from cache_service.blocks.keys import Namespace, prefix_hashes
    from cache_service.blocks.objects import encode, decode, object_size
    ns = Namespace("smollm2", "bfloat16", 30, 3, 64, block_tokens=16)
    hs = prefix_hashes(ns, list(range(16 * 64)))
    objs = [encode(ns, h, torch.randn(ns.block_shape).to(torch.bfloat16)) for h in hs]
    tier = HbmTier(128 * object_size(ns), object_size(ns))
    out["hbm_device"] = str(tier.device)
    out["hbm_put"] = all(in_thread(lambda: tier.put_many(hs, [o.to(dev) for o in objs])))
    got = in_thread(lambda: tier.get_many(hs))
    out["hbm_get_same"] = all(x is not None and x.device == tier.device and torch.equal(x.cpu(), o) for x, o in zip(got, objs))
    outs = [torch.empty(object_size(ns), dtype=torch.uint8).pin_memory() for _ in hs]
    hits = tier.get_into(hs, outs)
    out["hbm_get_into_pinned_same"] = all(hits) and all(torch.equal(a, b) for a, b in zip(outs, objs))
    out["hbm_decode_ok"] = all(decode(o, ns, h) is not None for o, h in zip(outs, hs))
    out["hbm_to_pinned_gbs"] = round(len(hs) * object_size(ns) / timed(lambda: tier.get_into(hs, outs), reps=5) / 1e9, 1)

section("hbm", hbm)

def sampler():
    """serve-engine's logit adjustments (min_tokens, logit_bias, penalties) on CUDA logits, against the CPU's."""
    from engine.sampler import adjusted
    from engine.sequence import SamplingParams, Sequence
    def request():
        seq = Sequence(1, [1, 5, 5, 8], SamplingParams(min_tokens=8, stop_token_ids=(7,), logit_bias={3: 5.0},
                                                       repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5))
        seq.token_ids += [5, 9, 9]
        return seq
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    cpu, gpu = adjusted(logits, request(), frozenset({2})), adjusted(logits.to(dev), request(), frozenset({2}))
    out["sampler_same"] = gpu.device == dev and torch.allclose(cpu, gpu.cpu())

section("sampler", sampler)
checks = {k: v for k, v in out.items() if k.endswith(("_same", "_put", "_ok"))}
ok = len(checks) == 16 and all(checks.values()) and not any(k.endswith("_error") for k in out)
print("gpu-check:", "ok" if ok else "FAILED")
print(json.dumps(out))
sys.exit(0 if ok else 1)
PY
