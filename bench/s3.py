"""S3 tier throughput as a ratio to raw boto3 on the same server, same run.

Store: ``S3Tier.put_many`` of N block objects vs a thread pool calling
``put_object`` on the same bytes. Load: ``S3Tier.get_many`` vs a pool calling
``get_object(...)["Body"].read()``. Both sides use the same concurrency and
the same botocore client settings (path-style, standard retries, checksums
"when required"), so the ratio is the tier's own overhead: batching,
accounting, tensor conversion. Repetitions are paired (each times all four
operations back to back) and the ratio is of medians.

The server is the real Ceph RADOS Gateway from ``scripts/servers.sh`` (started
here if it is not running). On a shared 2-core machine the gateway competes
with the client for CPU, so figures are noisy: read the ratios, not MB/s.

Usage: python bench/s3.py [--quick]. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import torch
from botocore.config import Config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tiers.s3 import S3Tier  # noqa: E402

# block object sizes (128-byte header + payload of one 16-token block, bf16)
SIZES = {"smollm2-135m": 128 + 30 * 2 * 16 * 3 * 64 * 2, "llama3-8b": 128 + 32 * 2 * 16 * 8 * 128 * 2}
CONCURRENCY = 8
BUCKET = "tierkv-bench"


def s3_endpoint() -> dict[str, str]:
    """Endpoint and credentials of the script's S3 server, starting it if needed."""
    state = Path(os.environ.get("TIERKV_SERVERS_DIR", "/tmp/tierkv-servers"))

    def env() -> dict[str, str]:
        try:
            lines = (state / "env").read_text().splitlines()
        except FileNotFoundError:
            return {}
        return dict(ln.removeprefix("export ").split("=", 1) for ln in lines if "=" in ln)

    def answers(url: str) -> bool:
        try:
            urllib.request.urlopen(url, timeout=3).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    e = env()
    if not answers(e.get("TIERKV_TEST_S3_ENDPOINT", "http://127.0.0.1:1")):
        subprocess.run(["bash", str(REPO / "scripts" / "servers.sh"), "start", "s3"], check=True,
                       stdout=sys.stderr)
        e = env()
    return {"endpoint_url": e["TIERKV_TEST_S3_ENDPOINT"], "access_key": e["TIERKV_TEST_S3_ACCESS_KEY"],
            "secret_key": e["TIERKV_TEST_S3_SECRET_KEY"]}


def raw_client(ep: dict[str, str]):
    cfg = Config(region_name="us-east-1", s3={"addressing_style": "path"}, connect_timeout=2.0,
                 read_timeout=10.0, retries={"mode": "standard", "total_max_attempts": 3},
                 max_pool_connections=2 * CONCURRENCY, request_checksum_calculation="when_required",
                 response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", endpoint_url=ep["endpoint_url"], config=cfg,
                                          aws_access_key_id=ep["access_key"],
                                          aws_secret_access_key=ep["secret_key"])


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_size(ep: dict[str, str], size: int, n: int, reps: int) -> dict[str, float]:
    """MB/s of raw boto3 and of the tier for store and load of n objects."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    tier = S3Tier(BUCKET, capacity_bytes=4 * n * size, prefix=prefix, max_concurrency=CONCURRENCY, **ep)
    client, pool = raw_client(ep), ThreadPoolExecutor(CONCURRENCY)
    g = torch.Generator().manual_seed(size)
    objs = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]
    hashes = [os.urandom(16) for _ in range(n)]
    bodies = [o.numpy().tobytes() for o in objs]
    raw_keys = [f"{prefix}-raw/{h.hex()}" for h in hashes]

    def raw_put():
        list(pool.map(lambda i: client.put_object(Bucket=BUCKET, Key=raw_keys[i], Body=bodies[i]), range(n)))

    def raw_get():
        list(pool.map(lambda k: client.get_object(Bucket=BUCKET, Key=k)["Body"].read(), raw_keys))

    def clear():  # both sides write fresh objects each repetition
        tier.delete_many(hashes)
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in raw_keys], "Quiet": True})

    rows = []
    try:
        raw_put(), tier.put_many(hashes, objs), raw_get(), tier.get_many(hashes)  # warm-up: connections
        for rep in range(reps):
            clear()
            row = {}
            # Alternate who goes first: the server's state after a burst of writes favours neither side.
            pairs = [(raw_put, lambda: tier.put_many(hashes, objs)), (raw_get, lambda: tier.get_many(hashes))]
            for raw_fn, tier_fn in pairs:
                order = [("raw", raw_fn), ("tier", tier_fn)][:: 1 if rep % 2 == 0 else -1]
                for who, fn in order:
                    row[(raw_fn.__name__, who)] = timed(fn)
            rows.append((row[("raw_put", "raw")], row[("raw_put", "tier")],
                         row[("raw_get", "raw")], row[("raw_get", "tier")]))
        got = tier.get_many(hashes)
        assert all(x is not None and torch.equal(x, o) for x, o in zip(got, objs)), "tier returned wrong bytes"
        assert tier.stats.errors == 0, f"tier errors: {tier.stats.as_dict()}"
    finally:
        clear()
        tier.close()
        pool.shutdown()
    mbs = [n * size / statistics.median(col) / 1e6 for col in zip(*rows)]
    return dict(zip(("boto3_put_mbs", "tier_put_mbs", "boto3_get_mbs", "tier_get_mbs"), mbs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer objects and repetitions (< 60 s)")
    args = ap.parse_args()
    ep = s3_endpoint()
    counts = {"smollm2-135m": 64, "llama3-8b": 16} if args.quick else {"smollm2-135m": 256, "llama3-8b": 64}
    reps = 6 if args.quick else 10
    results = {name: bench_size(ep, SIZES[name], counts[name], reps) for name in SIZES}
    print(f"S3 tier vs raw boto3 (Ceph RGW at {ep['endpoint_url']}, concurrency {CONCURRENCY}, "
          f"median of {reps} paired reps)")
    print(f"{'object':<14}{'bytes':>10}{'n':>5}  {'op':<6}{'boto3 MB/s':>12}{'tier MB/s':>11}{'ratio':>8}")
    out: dict[str, float] = {}
    for name, r in results.items():
        for op, raw, ours in (("store", "boto3_put_mbs", "tier_put_mbs"), ("load", "boto3_get_mbs", "tier_get_mbs")):
            ratio = r[ours] / r[raw]
            out[f"s3_{op}_vs_boto3_{name}"] = round(ratio, 3)
            print(f"{name:<14}{SIZES[name]:>10}{counts[name]:>5}  {op:<6}{r[raw]:>12.1f}{r[ours]:>11.1f}{ratio:>8.2f}")
    for op in ("load", "store"):  # headline: geometric mean over object sizes
        vals = [v for k, v in out.items() if k.startswith(f"s3_{op}_vs_boto3_")]
        out[f"s3_{op}_vs_boto3"] = round(math.exp(sum(map(math.log, vals)) / len(vals)), 3)
    print(json.dumps({"s3_load_vs_boto3": out.pop("s3_load_vs_boto3"),
                      "s3_store_vs_boto3": out.pop("s3_store_vs_boto3"), **out}))


if __name__ == "__main__":
    main()
