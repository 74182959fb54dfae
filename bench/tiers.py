"""Tier bandwidth and hashing throughput, each as a ratio to its physical peer
measured in the same run.

- CPU tier: put_many / get_into of block objects vs a plain torch copy of the
  same bytes into preallocated buffers (memcpy).
- Disk tier: put_many / get_many vs raw file writes (write + fsync + close
  per file, one after another as the tier's writer does) and reads (open +
  readinto + close, by as many threads as the tier reads with) of the same
  bytes and file sizes. Page cache dropped for the files read (posix_fadvise
  DONTNEED after an fsync), for both sides: reads come from the device.
- Hashing: our chained xxh3_128 block keys vs vLLM's default prefix hash
  sha256(pickle.dumps((parent, tuple(tokens), None))) on the same token lists
  (8,192-token prompts given as Python lists, 16-token blocks).

Usage: python bench/tiers.py [--quick]. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cache_service.blocks.keys import chain_hashes  # noqa: E402
from tiers.cpu import CpuTier  # noqa: E402
from tiers.disk import DiskTier  # noqa: E402
from tiers.disk_io import READ_THREADS  # noqa: E402
from bench._procs import drop_page_cache  # noqa: E402

# bytes per 16-token block: SmolLM2-135M bf16 (30 layers, 3 KV heads, dim 64), Llama-3-8B bf16
SIZES = {"smollm2-135m": 30 * 2 * 16 * 3 * 64 * 2, "llama3-8b": 32 * 2 * 16 * 8 * 128 * 2}


def timeit(fn, reps: int) -> float:
    """Median wall time of fn() over reps runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def objects(n: int, size: int) -> tuple[list[bytes], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(size)
    objs = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]
    return [os.urandom(16) for _ in range(n)], objs


def bench_cpu(n: int, size: int, reps: int) -> dict[str, float]:
    hashes, objs = objects(n, size)
    tier = CpuTier(capacity_bytes=n * size, slot_bytes=size)
    dst = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]

    def memcpy():
        for d, s in zip(dst, objs):
            d.copy_(s)

    def store() -> float:  # the timed part is the put; emptying the tier first is not
        tier.delete_many(hashes)
        return _time(lambda: tier.put_many(hashes, objs))

    memcpy(), store(), tier.get_into(hashes, dst)  # touch every page once
    rows = []
    for _ in range(reps):  # paired: each repetition times all three back to back
        rows.append((_time(memcpy), store(), _time(lambda: tier.get_into(hashes, dst))))
    assert all(torch.equal(d, s) for d, s in zip(dst, objs))
    tier.close()
    med = statistics.median
    return {"memcpy_gbs": n * size / med(r[0] for r in rows) / 1e9,
            "store_gbs": n * size / med(r[1] for r in rows) / 1e9,
            "load_gbs": n * size / med(r[2] for r in rows) / 1e9,
            "store_vs_memcpy": med(r[0] / r[1] for r in rows), "load_vs_memcpy": med(r[0] / r[2] for r in rows)}


def _raw_write(path, objs) -> None:
    """The objects written into consecutive slots of a preallocated segment
    file, then one fdatasync: the tier's layout (tiers/disk_slots.py) at
    the device's limit, without the tier's headers, checksums and index."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = objs[0].numel()
        if os.fstat(fd).st_size < size * len(objs):
            os.posix_fallocate(fd, 0, size * len(objs))
        for i, o in enumerate(objs):
            os.pwrite(fd, memoryview(o.numpy()), i * size)
        os.fdatasync(fd)
    finally:
        os.close(fd)


class RawReader:
    """The tier's own slots (the same bytes at the same offsets of the same
    files) read back by as many threads as the tier reads with
    (tiers/disk_io.py), into buffers faulted in once and reused, as the
    tier's arena rows are: the device's limit at that concurrency, with none
    of the tier's work (index, headers, checksums)."""

    def __init__(self, n: int, size: int) -> None:
        self.bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
        self.pool = ThreadPoolExecutor(READ_THREADS)

    def read(self, places: list[tuple[Path, int]]) -> None:
        fds = {path: os.open(path, os.O_RDONLY) for path in {p for p, _ in places}}
        try:
            list(self.pool.map(lambda i: os.preadv(fds[places[i][0]], [memoryview(self.bufs[i].numpy())],
                                                   places[i][1]), range(len(places))))
        finally:
            for fd in fds.values():
                os.close(fd)

    def close(self) -> None:
        self.pool.shutdown()


def bench_disk(n: int, size: int, reps: int, root: Path) -> dict[str, float]:
    hashes, objs = objects(n, size)
    raw_path = root / "raw-segment"
    tier = DiskTier(root / "tier", capacity_bytes=n * size * 2, fsync=True)
    raw = RawReader(n, size)

    def store() -> float:  # raw overwrites in place; the tier gets an empty slot, untimed
        tier.delete_many(hashes)
        return _time(lambda: tier.put_many(hashes, objs))

    def read_both(first_raw: bool) -> tuple[float, float]:
        places = [tier.location_of(h)[:2] for h in hashes]
        timed = {}
        for side in (["raw", "tier"] if first_raw else ["tier", "raw"]):  # either may go first
            drop_page_cache(raw_path, *tier.files())  # (the raw file too: the next writes start alike, uncached)
            timed[side] = _time(lambda: raw.read(places) if side == "raw" else tier.get_many(hashes))
        return timed["raw"], timed["tier"]

    w_raw, w_tier, r_raw, r_tier = [], [], [], []
    for rep in range(reps):  # interleave so noise hits both sides alike
        w_raw.append(_time(lambda: _raw_write(raw_path, objs)))
        w_tier.append(store())
        a, b = read_both(first_raw=rep % 2 == 0)
        r_raw.append(a)
        r_tier.append(b)
    got = tier.get_many(hashes)
    assert all(torch.equal(g, o) for g, o in zip(got, objs))
    raw.close()
    tier.close()
    med = statistics.median
    return {"raw_write_gbs": n * size / med(w_raw) / 1e9, "store_gbs": n * size / med(w_tier) / 1e9,
            "raw_read_gbs": n * size / med(r_raw) / 1e9, "load_gbs": n * size / med(r_tier) / 1e9,
            "store_vs_raw": med(a / b for a, b in zip(w_raw, w_tier)),
            "load_vs_raw": med(a / b for a, b in zip(r_raw, r_tier))}


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_hash(n_prompts: int, prompt_tokens: int, block_tokens: int, reps: int) -> dict[str, float]:
    """Hash n_prompts prompts of prompt_tokens each, one chain per prompt, as a
    connector does per request; the same token lists for both sides."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128_000, size=prompt_tokens).tolist() for _ in range(n_prompts)]
    total = n_prompts * prompt_tokens

    def vllm_default():
        for tokens in prompts:
            parent = None
            for i in range(0, prompt_tokens - block_tokens + 1, block_tokens):
                parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i:i + block_tokens]), None))).digest()

    def ours():
        for tokens in prompts:
            chain_hashes(bytes(16), tokens, block_tokens)

    rows = [(_time(vllm_default), _time(ours)) for _ in range(reps)]
    med = statistics.median
    return {"ours_mtok_s": total / med(r[1] for r in rows) / 1e6,
            "sha256_mtok_s": total / med(r[0] for r in rows) / 1e6, "vs_sha256": med(r[0] / r[1] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, finishes in well under 60 s")
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    total = (64 if args.quick else 256) * 2**20  # bytes moved per measurement
    root = Path(tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir))
    figures: dict[str, dict] = {}
    try:
        for name, size in SIZES.items():
            n = max(8, total // size)
            figures[f"cpu/{name}"] = bench_cpu(n, size, reps)
            sub = root / name
            sub.mkdir()
            figures[f"disk/{name}"] = bench_disk(max(8, n // 4), size, reps, sub)
        figures["hash"] = bench_hash(8 if args.quick else 64, 8192, 16, reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for k, v in figures.items():
        print(f"{k:24s} " + "  ".join(f"{a}={b:.3f}" for a, b in v.items() if not a.startswith("_")))
    pick = lambda kind, key: round(min(v[key] for k, v in figures.items() if k.startswith(kind)), 3)  # noqa: E731
    print(json.dumps({
        "cpu_store_vs_memcpy": pick("cpu/", "store_vs_memcpy"), "cpu_load_vs_memcpy": pick("cpu/", "load_vs_memcpy"),
        "disk_store_vs_raw": pick("disk/", "store_vs_raw"), "disk_load_vs_raw": pick("disk/", "load_vs_raw"),
        "hash_vs_sha256": round(figures["hash"]["vs_sha256"], 1),
    }))


if __name__ == "__main__":
    main()
