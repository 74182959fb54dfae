#!/usr/bin/env bash
# The CUDA paths on a lent GPU machine (torch + triton there; no lmdb/redis/boto3 needed):
# the HBM tier, the Triton kernels compiled for the GPU against their torch references,
# and vLLM's CUDA (flash-attention) layout adapter, each bit for bit. Last line: one JSON object.
set -uo pipefail
cd "$(dirname "$0")/.."
exec python3 - <<'PY'
import json, sys, time
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

def same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16) if a.element_size() == 2 else a,
                                               b.view(torch.int16) if b.element_size() == 2 else b)

def timed(fn, reps=20):
    fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / reps

dev, g = torch.device("cuda", 0), torch.Generator(device="cuda").manual_seed(0)
# 1. our engine's paged cache: Triton gather/scatter compiled for the GPU vs the torch reference
L, P, page, H, D, ppb = 30, 256, 16, 3, 64, 1
cache = torch.randn(L, 2, P, page, H, D, device=dev, generator=g).to(torch.bfloat16)
ids = torch.randperm(P, device=dev)[:120].view(-1, ppb)
tri = gather_blocks(cache, ids, impl="triton")
ref = gather_blocks_ref(cache, ids.view(-1, ppb), torch.empty_like(tri))
out["paged_gather_same"] = same(tri, ref)
back = torch.zeros_like(cache)
scatter_blocks(tri, ids, back, impl="triton")
out["paged_scatter_same"] = same(gather_blocks(back, ids, impl="torch"), ref)
nbytes = tri.numel() * 2
out["paged_gather_gbs"] = round(nbytes / timed(lambda: gather_blocks(cache, ids, out=tri, impl="triton")) / 1e9, 1)
out["paged_gather_torch_gbs"] = round(nbytes / timed(lambda: gather_blocks(cache, ids, out=tri, impl="torch")) / 1e9, 1)
# 2. vLLM's CUDA layout: per layer [2, pages, page, H, D] (flash-attention)
layers = [torch.randn(2, P, page, H, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(L)]
fl = gather_vllm_flash(layers, ids, impl="triton")
out["flash_gather_same"] = same(fl, gather_vllm_flash_ref(layers, ids, torch.empty_like(fl)))
dst = [torch.zeros_like(x) for x in layers]
scatter_vllm_flash(fl, ids, dst, impl="triton")
out["flash_scatter_same"] = same(gather_vllm_flash(dst, ids, impl="torch"), fl)
out["flash_gather_gbs"] = round(nbytes / timed(lambda: gather_vllm_flash(layers, ids, out=fl, impl="triton")) / 1e9, 1)
# 3. the HBM tier: objects in device slots, read back to the GPU and into pinned host buffers
from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.blocks.objects import encode, decode, object_size
ns = Namespace("smollm2", "bfloat16", 30, 3, 64, block_tokens=16)
hs = prefix_hashes(ns, list(range(16 * 64)))
objs = [encode(ns, h, torch.randn(ns.block_shape).to(torch.bfloat16)) for h in hs]
tier = HbmTier(128 * object_size(ns), object_size(ns))
out["hbm_put"] = all(tier.put_many(hs, [o.to(dev) for o in objs]))
got = tier.get_many(hs)
out["hbm_get_same"] = all(g_ is not None and g_.device.type == "cuda" and torch.equal(g_.cpu(), o) for g_, o in zip(got, objs))
outs = [torch.empty(object_size(ns), dtype=torch.uint8).pin_memory() for _ in hs]
hits = tier.get_into(hs, outs)
out["hbm_get_into_pinned_same"] = all(hits) and all(torch.equal(a, b) for a, b in zip(outs, objs))
out["hbm_decode_ok"] = all(decode(o, ns, h) is not None for o, h in zip(outs, hs))
t = timed(lambda: tier.get_into(hs, outs), reps=5)
out["hbm_to_pinned_gbs"] = round(len(hs) * object_size(ns) / t / 1e9, 1)
ok = all(v for k, v in out.items() if k.endswith(("_same", "_put", "_ok")))
print("gpu-check:", "ok" if ok else "FAILED")
print(json.dumps(out))
sys.exit(0 if ok else 1)
PY
