"""Soak: the reliability suite's load (8 clients, both data paths, stores and
verified loads) against one `tierkv serve` process for as long as asked,
printing a line per interval: ops/s, p50/p99 latency, errors, wrong blocks,
the daemon's resident memory and its growth since the end of warm-up.

Usage: python bench/soak.py [--minutes 10] [--interval 10] [--clients 8]
       python bench/soak.py --quick       (45 s, 5 s intervals)
Last line: one JSON object (ops, errors, wrong, p99_ms, rss_growth_pct, seconds).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from connectors.grpc.client import GrpcClient  # noqa: E402
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same  # noqa: E402
from tests.reliability.conftest import Daemon, cpu_disk_config  # noqa: E402

RING, BATCH = 512, 8


class Tally:
    """Latencies and counts since the last `take()`, shared by the clients."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lat: list[float] = []
        self.wrong = 0

    def add(self, seconds: float, wrong: int) -> None:
        with self.lock:
            self.lat.append(seconds)
            self.wrong += wrong

    def take(self) -> tuple[list[float], int]:
        with self.lock:
            lat, wrong, self.lat, self.wrong = self.lat, self.wrong, [], 0
        return lat, wrong


def client(url: str, k: int, stop: threading.Event, tally: Tally, errors: list[int]) -> None:
    """Store and verify-load this client's own ring of blocks until `stop`."""
    rng, ring = random.Random(k), hashes(RING, start=10_000_000 * (k + 1))
    with GrpcClient(url) as c:
        n = 0
        while not stop.is_set():
            i = (n * BATCH) % RING
            t0 = time.perf_counter()
            if n < RING // BATCH or rng.random() < 0.5:
                c.store(NS, ring[i:i + BATCH], [payload_for(h) for h in ring[i:i + BATCH]])
                wrong = 0
            else:
                j = rng.randrange(0, RING - BATCH + 1)
                got = c.load(NS, ring[j:j + BATCH])
                wrong = sum(g is None or not same(g, payload_for(h)) for g, h in zip(got, ring[j:j + BATCH]))
            tally.add(time.perf_counter() - t0, wrong)
            n += 1
        errors[k] = c.errors


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) >= 2 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="45 s in 5 s intervals")
    args = ap.parse_args()
    total_s, interval = (45.0, 5.0) if args.quick else (args.minutes * 60, args.interval)
    root = Path(tempfile.mkdtemp(prefix="tierkv-soak-"))
    d = Daemon(root, cpu_disk_config(root, 256 * OBJ, "64MiB", fsync=False)).start()
    stop, tally, errors = threading.Event(), Tally(), [0] * args.clients
    threads = [threading.Thread(target=client, args=(d.url("shm" if k % 2 else "stream"), k, stop, tally, errors))
               for k in range(args.clients)]
    for t in threads:
        t.start()
    ops = wrong_total = 0
    rss0, p99s, t_start = None, [], time.monotonic()
    try:
        while time.monotonic() - t_start < total_s:
            time.sleep(interval)
            lat, wrong = tally.take()
            ops, wrong_total, rss = ops + len(lat), wrong_total + wrong, d.rss_kib()
            rss0 = rss0 or rss  # the first interval is the warm-up
            p99s.append(pct(lat, 99))
            print(f"t={time.monotonic() - t_start:7.1f}s ops/s={len(lat) / interval:8.1f} p50={pct(lat, 50):7.2f}ms "
                  f"p99={p99s[-1]:7.2f}ms wrong={wrong} rss={rss / 1024:7.1f}MiB growth={100 * (rss - rss0) / rss0:+.1f}%",
                  flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        d.stop()
    print(json.dumps({"ops": ops, "errors": sum(errors), "wrong": wrong_total, "p99_ms": round(max(p99s), 2),
                      "rss_growth_pct": round(100 * (rss - rss0) / rss0, 2) if rss0 else None,
                      "seconds": round(time.monotonic() - t_start, 1)}))


if __name__ == "__main__":
    main()
