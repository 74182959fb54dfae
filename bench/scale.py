"""The embedded store at NVMe scale: how opening, memory, lookups and stores
grow with the blocks its disk tier holds (issue #19).

For each size N of the curve, the disk tier is filled until it holds N
block objects (small ones, 1,152 bytes: a 1-layer, 1-head, dim-16
namespace, filled with fsync off, in batches; the blocks the earlier
points' store rates added count), then a fresh process measures, on the embedded
store (`open_store`, cpu -> disk, as `local://` builds it):

- reopen: seconds from `open_store` to a store that answers, the median
  of 5 opens in that process (each but the last closed at once: the
  figure is milliseconds, where one late thread start is noise); after the
  last, the disk tier's background sweep (free slots, damaged records) is
  waited out before the lookups, and its end reported;
- RSS per block: the larger of the process's resident memory growth over
  that open and its anonymous memory growth once the sweep is done and the
  lookups ran (the presence table), / N;
- index bytes per block: the lmdb index's pages in use / N;
- lookup of 256 held hashes: `store.lookup` latency, p50 and p99 (us);
- store rate: new blocks of the same size stored through the store (64 per
  call, as one tensor: what the connectors hand over) with
  fsync on, until flushed (524k of them, 262k with --quick: two or one of
  the disk tier's index merges fall within), as a ratio to raw writes of the same objects
  into slots of a preallocated segment file with one fdatasync per batch
  the store's writer takes (the disk tier's layout, tiers/disk_slots.py,
  less everything else it does); and, for the layout question (#19 item
  3), the same objects as one file each (write, fsync by 8 threads,
  rename, one directory fsync per batch) against segment slots, at this
  bench's block size and at real models'. The same store rate with
  SmolLM2-135M's blocks (368 KiB) shows the device's share at real sizes.

The 10M figures are extrapolated from the last two points (labelled so).
Usage: python bench/scale.py [--quick] [--dir D] [--plot PNG]; --quick: 100k
blocks only, under 60 s. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cache_service.blocks.keys import Namespace  # noqa: E402
from cache_service.blocks.objects import encode  # noqa: E402
from cache_service.store.writer import WRITE_BATCH  # noqa: E402
from tiers.disk_fresh import MERGE_RECORDS  # noqa: E402

NS = Namespace("scale-bench", "bfloat16", num_layers=1, kv_heads=1, head_dim=16, block_tokens=16)
SMOLLM2 = Namespace("scale-bench-smollm2", "bfloat16", num_layers=30, kv_heads=3, head_dim=64, block_tokens=16)
BATCH = 2000
REOPENS = 5  # opens per point, the median kept: a few ms each, where one thread start on 2 shared cores is noise
FILE_SYNC_THREADS = 8  # raw files fsynced concurrently (the one-file-per-block layout's best rate here)


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def payload(i: int, ns: Namespace = NS) -> torch.Tensor:
    return torch.full(ns.block_shape, float(i % 251), dtype=torch.bfloat16)


def fill(root: Path, start: int, end: int) -> float:
    """Add blocks start..end-1 to the disk tier at root (fsync off); seconds taken."""
    from tiers.disk import DiskTier

    t0 = time.perf_counter()
    tier = DiskTier(root, 1 << 42, fsync=False)
    for a in range(start, end, BATCH):
        ids = range(a, min(end, a + BATCH))
        hs = [key(i) for i in ids]
        tier.put_many(hs, [encode(NS, h, payload(i)) for h, i in zip(hs, ids)])
    tier.close()
    os.sync()  # the fill's writeback done here, not competing with the probe's store and raw rates
    return time.perf_counter() - t0


def config(root: Path, fsync: bool):
    from cache_service.config import load_config

    return load_config(env={}, overrides={"tiers": {"cpu": {"capacity": "64MiB"},
                                                    "disk": {"path": str(root), "capacity": 1 << 42, "fsync": fsync}}})


def rss_bytes(field: str = "VmRSS:") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def probe(root: Path, n: int, ids: int, scratch: Path, count: int) -> dict:
    """Run in a fresh process: the figures of a store holding n blocks, of
    which the fill's are ids 0..ids-1 (the rest earlier probes stored);
    its store rate stores `count` new blocks."""
    from cache_service.factory import open_store
    from tiers.disk_index import bytes_in_use

    open_store(config(root.parent / "empty", fsync=True)).close()  # imports and one-time set-up, not counted
    opens = []
    for _ in range(REOPENS - 1):  # opened and closed at once (its sweep stopped); the last one is measured on
        t0 = time.perf_counter()
        early = open_store(config(root, fsync=True))
        opens.append(time.perf_counter() - t0)
        early.close()
    before, anon_before = rss_bytes(), rss_bytes("RssAnon:")
    t0 = time.perf_counter()
    store = open_store(config(root, fsync=True))
    opens.append(time.perf_counter() - t0)
    reopen = statistics.median(opens)
    rss = rss_bytes() - before
    assert store.tiers[-1].swept.wait(3600)  # the background sweep after open: steady state from here
    sweep = time.perf_counter() - t0
    lat = []
    for r in range(300):
        hs = [key((r * 7919 + j * 104729) % ids) for j in range(256)]
        t = time.perf_counter()
        got = store.lookup(hs)
        lat.append((time.perf_counter() - t) * 1e6)
        assert got == len(hs), f"only {got} of 256 held blocks found"
    lat.sort()
    anon = rss_bytes("RssAnon:") - anon_before
    index_bytes = bytes_in_use(root / "index.lmdb")  # before the store rates below add their blocks
    ours, raw = store_rate(store, n, scratch, count)
    real, real_raw = store_rate(store, n, scratch, 128, 2, SMOLLM2, 2 * 10**9)  # a real model's blocks: the device's share
    obj = encode(NS, key(0), payload(0)).numpy().tobytes()
    files = files_rate(scratch, 4000, [obj])
    store.close()
    shutil.rmtree(root.parent / "empty", ignore_errors=True)
    # the figure: the larger of RSS growth over the open and the anonymous memory kept once the sweep has
    # filled the presence table (lmdb's mapped pages are page cache, shared and reclaimable)
    return {"blocks": n, "stored": count + 128, "reopen_s": reopen, "sweep_s": sweep, "rss_bytes_per_block": max(rss, anon) / n,
            "rss_open_bytes_per_block": rss / n, "anon_rss_bytes_per_block_after_sweep": anon / n, "raw_files_blocks_s": files,
            "index_bytes_per_block": index_bytes / n,
            "lookup256_us_p50": lat[len(lat) // 2], "lookup256_us_p99": lat[int(len(lat) * 0.99)],
            "store_blocks_s": ours, "raw_blocks_s": raw, "store_rate_vs_raw": ours / raw,  # raw: segment writes
            "smollm2_store_blocks_s": real, "smollm2_store_rate_vs_raw": real / real_raw}


def store_rate(store, n: int, scratch: Path, count: int, rounds: int = 4,
               ns: Namespace = NS, base: int = 10**9) -> tuple[float, float]:
    """Blocks/s of new blocks stored and flushed (fsync on), and of raw
    writes of the same objects into slots of a segment file, one fdatasync
    per batch the store's writer takes (what the disk tier does, less all
    the rest): `rounds` alternating pairs (this VM's disk drifts by 2x
    within a minute), the medians. The probes store one (--quick) or two of
    the disk tier's index merges (tiers/disk_fresh.py), which fall inside the rounds."""
    ours, raw = [], []
    per = count // rounds
    for r in range(rounds):
        ids = range(n + base + r * per, n + base + (r + 1) * per)
        hs = [key(i) for i in ids]
        payloads = torch.stack([payload(i, ns) for i in ids])  # as the connectors hand blocks over: one tensor
        objs = [encode(ns, h, p).numpy().tobytes() for h, p in zip(hs, payloads)]
        t0 = time.perf_counter()
        for a in range(0, per, 64):
            store.store(ns, hs[a:a + 64], payloads[a:a + 64])
        assert store.flush(300)
        ours.append(per / (time.perf_counter() - t0))
        raw.append(segment_rate(scratch, per, objs, WRITE_BATCH))
    return statistics.median(ours), statistics.median(raw)


def segment_rate(scratch: Path, count: int, objs: list[bytes], batch: int = WRITE_BATCH) -> float:
    """Blocks/s of the segment layout (the disk tier's, item 3 of #19): the
    objects written into slots of one preallocated segment file, one
    fdatasync per `batch`."""
    scratch.mkdir(parents=True, exist_ok=True)
    slot = max(len(o) for o in objs)
    fd = os.open(scratch / "segment", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, count * slot)
        os.fsync(fd)
        t0 = time.perf_counter()
        for a in range(0, count, batch):
            for j in range(a, min(count, a + batch)):
                os.pwrite(fd, objs[j % len(objs)], j * slot)
            os.fdatasync(fd)
        rate = count / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)
    return rate


def files_rate(scratch: Path, count: int, objs: list[bytes], names: list[str] | None = None) -> float:
    """Blocks/s of raw files: each batch (as many as the store's writer takes
    at a time) written to temp files, fsynced
    by as many threads as the tier syncs with, renamed, one directory fsync."""
    scratch.mkdir(parents=True, exist_ok=True)
    names = names or [f"{j:032x}" for j in range(count)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(FILE_SYNC_THREADS) as pool:
        for a in range(0, count, WRITE_BATCH):
            batch = range(a, min(count, a + WRITE_BATCH))
            fds = []
            for j in batch:
                fds.append(os.open(scratch / f".tmp-{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
                os.write(fds[-1], objs[j % len(objs)])
            list(pool.map(os.fsync, fds))
            for j, fd in zip(batch, fds):
                os.close(fd)
                os.rename(scratch / f".tmp-{j}", scratch / names[j])
            dfd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(dfd)
            os.close(dfd)
    rate = count / (time.perf_counter() - t0)
    shutil.rmtree(scratch, ignore_errors=True)
    return rate


LAYOUT_SIZES = {"1.1 KiB (this bench)": 1152, "64 KiB": 64 << 10,
                "368 KiB (SmolLM2-135M, 16 tokens, bf16)": 368 << 10, "2 MiB (Llama-3-8B, 16 tokens, bf16)": 2 << 20}


def layouts(scratch: Path, quick: bool) -> list[dict]:
    """Raw files vs segment slots at block sizes of real models (same bytes per row)."""
    rows = []
    for label, size in LAYOUT_SIZES.items():
        count = max(64, min(4000, (64 if quick else 256) * 2**20 // size))
        obj = os.urandom(size)
        files = files_rate(scratch, count, [obj])
        seg = segment_rate(scratch, count, [obj], WRITE_BATCH)  # the sync batch of the files side and the probe
        rows.append({"object": label, "bytes": size, "blocks": count, "files_blocks_s": files,
                     "segment_blocks_s": seg, "segment_vs_files": seg / files})
        print(f"layout {label:>40}: files {files:9.0f} blocks/s ({files * size / 2**20:6.1f} MiB/s)  segment "
              f"{seg:9.0f} blocks/s ({seg * size / 2**20:6.1f} MiB/s)  segment/files {seg / files:5.2f}", flush=True)
    return rows


def measure(root: Path, n: int, ids: int, count: int) -> dict:
    """`probe` in a fresh process (what a restarted engine or daemon pays)."""
    run = subprocess.run([sys.executable, __file__, "--probe", str(root), str(n), str(ids), str(count)], capture_output=True, text=True,
                         timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if run.returncode != 0:
        raise RuntimeError(f"probe failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.splitlines()[-1])


def extrapolate(curve: list[dict], n: int, k: str) -> float:
    """Linear in the blocks held, through the last two points (a falling figure, noise, is taken as flat)."""
    a, b = curve[-2], curve[-1]
    slope = max(0.0, (b[k] - a[k]) / (b["blocks"] - a["blocks"]))
    return b[k] + slope * (n - b["blocks"])


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [c["blocks"] / 1e6 for c in curve]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for ax, (k, label) in zip(axes, (("reopen_s", "reopen (s)"), ("rss_bytes_per_block", "RSS per block (B)"),
                                     ("lookup256_us_p99", "lookup of 256, p99 (us)"))):
        ax.plot(xs, [c[k] for c in curve], marker="o")
    axes[3].plot(xs, [c["store_blocks_s"] / 1e3 for c in curve], marker="o", label="store (fsync on)")
    axes[3].plot(xs, [c["raw_blocks_s"] / 1e3 for c in curve], marker="s", label="raw segment writes")
    axes[3].legend()
    for ax, label in zip(axes, ("reopen (s)", "RSS per block (B)", "lookup of 256, p99 (us)",
                                "1.1 KiB blocks stored (thousands/s)")):
        ax.set_ylim(bottom=0)
        ax.set_xlabel("blocks held (millions)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k blocks only (under 60 s)")
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--plot", default=None, help="write the curve as a PNG here (needs matplotlib)")
    ap.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        root = Path(args.probe[0])
        print(json.dumps(probe(root, int(args.probe[1]), int(args.probe[2]), root.parent / "raw-scratch", int(args.probe[3]))))
        return
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # said before the run, not after it
        sys.exit("bench/scale.py: --plot needs matplotlib (pip install -e '.[bench]')")
    sizes = [100_000] if args.quick else [300_000, 1_000_000, 3_000_000]
    base = Path(tempfile.mkdtemp(prefix="tierkv-scale-", dir=args.dir))
    curve, ids, stored = [], 0, 0  # the fill's ids so far; blocks the probes' store rates added
    try:
        for n in sizes:  # filled up to n blocks held in all (the table sizes of the presence table are powers of 2)
            fill_s = fill(base / "store", ids, n - stored)
            ids = n - stored
            row = measure(base / "store", n, ids, (1 if args.quick else 2) * MERGE_RECORDS) | {"fill_s": fill_s}
            stored += row["stored"]
            curve.append(row)
            print(f"{n:>9,} blocks  reopen {row['reopen_s'] * 1e3:.1f} ms  RSS over open {row['rss_open_bytes_per_block']:.0f} "
                  f"B/block  "
                  f"index {row['index_bytes_per_block']:.0f} B/block  lookup256 p50/p99 "
                  f"{row['lookup256_us_p50']:.0f}/{row['lookup256_us_p99']:.0f} us  store {row['store_blocks_s']:.0f} "
                  f"blocks/s ({row['store_rate_vs_raw']:.2f} of raw; SmolLM2 blocks {row['smollm2_store_rate_vs_raw']:.2f})  sweep done {row['sweep_s']:.1f} s  anon RSS "
                  f"after it {row['anon_rss_bytes_per_block_after_sweep']:.0f} B/block  raw segment/files "
                  f"{row['raw_blocks_s']:.0f}/{row['raw_files_blocks_s']:.0f} blocks/s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    table = layouts(base.parent / f"{base.name}-layouts", args.quick)
    last = curve[-1]
    totals = [{"blocks": c["blocks"], "rss_bytes": c["rss_bytes_per_block"] * c["blocks"]} for c in curve]
    if len(curve) > 1:
        print(f"10,000,000 blocks (extrapolated, linear through the last two points): reopen "
              f"{extrapolate(curve, 10**7, 'reopen_s') * 1e3:.1f} ms, RSS "
              f"{extrapolate(totals, 10**7, 'rss_bytes') / 2**30:.2f} GiB in all")
    if args.plot:
        plot(curve, Path(args.plot))
    tag = "3m" if last["blocks"] == 3_000_000 else f"{last['blocks'] // 1000}k"
    print(json.dumps({"blocks": last["blocks"], f"reopen_s_{tag}": round(last["reopen_s"], 3),
                      f"rss_bytes_per_block_{tag}": round(last["rss_bytes_per_block"], 1),
                      f"lookup256_us_p99_{tag}": round(last["lookup256_us_p99"], 1),
                      "reopen_growth": round(curve[-1]["reopen_s"] / curve[0]["reopen_s"], 2) if len(curve) > 1 else None,
                      "store_rate_vs_raw": round(last["store_rate_vs_raw"], 3),
                      "smollm2_store_rate_vs_raw": round(last["smollm2_store_rate_vs_raw"], 3),
                      "segment_vs_files_raw": round(last["raw_blocks_s"] / last["raw_files_blocks_s"], 2),
                      "segment_vs_files_by_size": {r["bytes"]: round(r["segment_vs_files"], 2) for r in table}}))


if __name__ == "__main__":
    main()
