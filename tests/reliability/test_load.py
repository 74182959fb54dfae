"""Sustained load: 8 concurrent clients (both data paths) against one daemon
for 60 s (5 s warm-up, 55 s measured; bench/soak.py runs the same load for
as long as asked). No errors, no wrong block, resident memory of the daemon grows
less than 10% after warm-up; p50/p99 latencies are printed, not asserted."""
from __future__ import annotations

import random
import statistics
import threading
import time

import pytest

from connectors.grpc.client import GrpcClient
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tests.reliability.conftest import cpu_disk_config, figure

pytestmark = pytest.mark.slow
CLIENTS, WARMUP_S, MEASURE_S = 8, 5.0, 55.0
RING, BATCH = 512, 8  # each client cycles over its own RING blocks: a steady state after the first lap


def client_loop(url: str, k: int, stop: threading.Event, out: dict) -> None:
    rng = random.Random(k)
    ring = hashes(RING, start=10_000_000 * (k + 1))
    lat = {"store": [], "load": []}
    wrong = ops = 0
    with GrpcClient(url) as c:
        for n in range(1_000_000):  # bounded; ended by `stop`
            if stop.is_set():
                break
            i = (n * BATCH) % RING
            if n < RING // BATCH or rng.random() < 0.5:
                hs, op = ring[i:i + BATCH], "store"
                t0 = time.perf_counter()
                c.store(NS, hs, [payload_for(h) for h in hs])
            else:
                j = rng.randrange(0, min(RING, n * BATCH) - BATCH + 1)
                hs, op = ring[j:j + BATCH], "load"
                t0 = time.perf_counter()
                got = c.load(NS, hs)
                wrong += sum(g is None or not same(g, payload_for(h)) for g, h in zip(got, hs))
            lat[op].append(time.perf_counter() - t0)
            ops += 1
        out[k] = {"lat": lat, "wrong": wrong, "ops": ops, "errors": c.errors, "transport": c.transport}


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) >= 2 else float("nan")


def test_eight_clients_sustained(daemons, tmp_path):
    root = tmp_path / "load"
    d = daemons(cpu_disk_config(root, 256 * OBJ, "64MiB", fsync=False), name="load").start()
    stop, out = threading.Event(), {}
    urls = [d.url("shm" if k % 2 else "stream") for k in range(CLIENTS)]
    threads = [threading.Thread(target=client_loop, args=(urls[k], k, stop, out)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        time.sleep(WARMUP_S)
        rss_warm = d.rss_kib()
        samples, t_end = [], time.monotonic() + MEASURE_S
        while time.monotonic() < t_end:
            time.sleep(1.0)
            samples.append(d.rss_kib())
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads) and len(out) == CLIENTS
    stores = [x for r in out.values() for x in r["lat"]["store"]]
    loads = [x for r in out.values() for x in r["lat"]["load"]]
    errors, wrong = sum(r["errors"] for r in out.values()), sum(r["wrong"] for r in out.values())
    growth = (max(samples) - rss_warm) / rss_warm
    figure("load", clients=CLIENTS, seconds=WARMUP_S + MEASURE_S, ops=len(stores) + len(loads),
           ops_per_s=(len(stores) + len(loads)) / (WARMUP_S + MEASURE_S), errors=errors, wrong=wrong,
           store_p50_ms=pct(stores, 50), store_p99_ms=pct(stores, 99), load_p50_ms=pct(loads, 50),
           load_p99_ms=pct(loads, 99), rss_warm_mib=rss_warm / 1024, rss_max_mib=max(samples) / 1024,
           rss_growth_pct=100 * growth, transports=",".join(sorted({r["transport"] for r in out.values()})))
    assert errors == 0 and wrong == 0
    assert growth < 0.10
    assert d.stop() == 0  # a clean drain after the load
