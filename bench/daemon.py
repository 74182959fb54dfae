"""Daemon bandwidth: load and store through `tierkv serve`, as ratios to the
physical limit and to a peer, all measured in the same run.

- Physical limit: memcpy of the same bytes (a torch copy of each block into a
  preallocated buffer), in this process. For the streamed path also the
  bytes through a raw loopback TCP socket (`socket_vs_memcpy`): no framing,
  no copies, no checks, so no streamed path on this host can beat it.
- Ours: a `GrpcClient` against a real daemon subprocess (CPU tier only, so
  the figure is the daemon path, not the disk), (a) over shared memory and
  (b) streaming bytes over the socket. Stores use fresh keys every
  repetition (a repeated key is not new and skips the work).
- Peer: a real local redis-server (no persistence), pipelined SET / GET of
  the same block sizes from pre-built bytes (its best case: no tensor
  conversion on either side). The vs-Redis figures use the path a same-host
  client picks by itself (shared memory).

Usage: python bench/daemon.py [--quick]. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cache_service.blocks.keys import Namespace  # noqa: E402
from cache_service.blocks.objects import object_size  # noqa: E402
from bench._procs import free_port, wait_port  # noqa: E402
from connectors.grpc.client import GrpcClient  # noqa: E402
from tiers.host_copy import in_halves  # noqa: E402

# the namespaces of bench/tiers.py's block sizes: SmolLM2-135M and Llama-3-8B, bf16, 16 tokens
SHAPES = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64),
          "llama3-8b": ("meta-llama/Meta-Llama-3-8B", 32, 8, 128)}


def start_daemon(root: Path, capacity: int, slot: int) -> tuple[subprocess.Popen, int]:
    cfg = root / "tierkv.toml"
    cfg.write_text(f"[store]\nqueue_full = \"skip\"\n\n[tiers.cpu]\ncapacity = {capacity}\nslot_bytes = {slot}\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--config", str(cfg),
                             "--listen", f"127.0.0.1:{port}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=open(root / "daemon.log", "w"))
    wait_port(port, proc, "tierkv daemon", 60.0)
    return proc, port


def start_redis(root: Path) -> tuple[int, "object"]:
    import redis

    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    port = free_port()
    subprocess.run(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                    "--daemonize", "yes", "--pidfile", str(root / "redis.pid"), "--dir", str(root),
                    "--logfile", str(root / "redis.log"), "--proto-max-bulk-len", "1gb"], check=True)
    wait_port(port, None, "redis-server", 60.0)
    return port, redis.Redis(host="127.0.0.1", port=port)


def stop_redis(root: Path) -> None:
    try:
        os.kill(int((root / "redis.pid").read_text()), signal.SIGTERM)
    except (OSError, ValueError):
        pass


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class SocketCeiling:
    """The streaming path's physical limit here: the same bytes through a raw
    loopback TCP socket (a thread sends, this thread receives into one
    buffer; no framing, no copies, no checks), in this process."""

    def __init__(self, data: bytes) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self._tx = socket.create_connection(listener.getsockname())
        self._rx, _ = listener.accept()
        listener.close()
        self._src = memoryview(data)
        self._dst = memoryview(bytearray(len(self._src)))
        self._go = threading.Semaphore(0)
        threading.Thread(target=self._send, daemon=True).start()

    def _send(self) -> None:
        while self._go.acquire() and self._src is not None:
            self._tx.sendall(self._src)

    def transfer(self) -> None:
        self._go.release()
        got = 0
        while got < len(self._dst):
            got += self._rx.recv_into(self._dst[got:])

    def close(self) -> None:
        self._src = None
        self._go.release()
        self._tx.close()
        self._rx.close()


def bench_size(name: str, n: int, reps: int, root: Path) -> dict[str, float]:
    model, layers, heads, dim = SHAPES[name]
    ns = Namespace(model, "bfloat16", layers, heads, dim, block_tokens=16)
    size = ns.payload_bytes
    g = torch.Generator().manual_seed(0)
    payloads = [torch.randn(ns.block_shape, generator=g).to(torch.bfloat16) for _ in range(n)]
    dst = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
    flat = [p.view(-1).view(torch.uint8) for p in payloads]
    blobs = [f.numpy().tobytes() for f in flat]
    keysets = [[os.urandom(16) for _ in range(n)] for _ in range(2 * reps + 6)]

    def memcpy():  # the limit at our copies' parallelism: two halves on two threads where ours split (in_halves)
        def copy(a: int, b: int) -> list:
            for d, s in zip(dst[a:b], flat[a:b]):
                d.copy_(s)
            return []
        in_halves(copy, [size] * n)

    # a pool of 4 batches, warmed below: timed stores recycle evicted slots (steady state),
    # as in a daemon that has been running, instead of faulting in never-touched memory
    proc, port = start_daemon(root, 4 * n * object_size(ns), object_size(ns))
    rport, r = start_redis(root)
    wire = SocketCeiling(b"".join(blobs))
    rows: dict[str, list[float]] = {k: [] for k in ("memcpy", "shm_load", "shm_store", "stream_load",
                                                    "stream_store", "redis_get", "redis_set", "socket")}
    try:
        clients = {t: GrpcClient(f"grpc://127.0.0.1:{port}?transport={t}", shm_bytes=n * object_size(ns))
                   for t in ("shm", "stream")}
        fresh = iter(keysets)
        for t, c in clients.items():  # warm up: every slot touched, every path taken once
            c.store(ns, next(fresh), payloads)
            c.store(ns, next(fresh), payloads)
        loaded = next(fresh)
        clients["shm"].store(ns, loaded, payloads)
        memcpy()
        for _ in range(reps):  # paired: each repetition times everything back to back
            rows["memcpy"].append(_time(memcpy))
            rows["socket"].append(_time(wire.transfer))
            for t, c in clients.items():
                keys = next(fresh)
                rows[f"{t}_store"].append(_time(lambda: c.store(ns, keys, payloads)))
                rows[f"{t}_load"].append(_time(lambda: c.load(ns, loaded)))
            rows["redis_set"].append(_time(lambda: r.pipeline(transaction=False).mset(
                {f"k{i}": b for i, b in enumerate(blobs)}).execute()))
            rows["redis_get"].append(_time(lambda: r.mget([f"k{i}" for i in range(n)])))
        for c in clients.values():  # both paths returned the stored bytes
            out = c.load(ns, loaded)
            assert all(o is not None and torch.equal(o.view(-1).view(torch.uint8), f) for o, f in zip(out, flat))
            del out
        assert clients["shm"].lookup(loaded) == n
        for c in clients.values():
            c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        stop_redis(root)
        wire.close()
    med = statistics.median
    ratio = lambda a, b: med(x / y for x, y in zip(rows[a], rows[b]))  # noqa: E731
    fig = {f"{k}_gbs": n * size / med(v) / 1e9 for k, v in rows.items()}
    for t in ("shm", "stream"):
        fig[f"{t}_load_vs_memcpy"] = ratio("memcpy", f"{t}_load")
        fig[f"{t}_store_vs_memcpy"] = ratio("memcpy", f"{t}_store")
    fig["socket_vs_memcpy"] = ratio("memcpy", "socket")  # the ceiling of any streamed path on this host
    fig["load_vs_redis"] = ratio("redis_get", "shm_load")
    fig["store_vs_redis"] = ratio("redis_set", "shm_store")
    return fig


def main() -> None:
    # one torch thread per copy for memcpy and for our client alike (OpenMP teams spinning next to grpc's
    # threads on a small shared machine distort both sides); both split a large batch over two threads
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one block size, few repetitions (well under 60 s)")
    args = ap.parse_args()
    reps = 11 if args.quick else 15
    total = (32 if args.quick else 128) * 2**20  # payload bytes per measurement
    names = ["smollm2-135m"] if args.quick else list(SHAPES)
    figures = {}
    root = Path(tempfile.mkdtemp(prefix="tierkv-bench-daemon-"))
    try:
        for name in names:
            model, layers, heads, dim = SHAPES[name]
            size = layers * 2 * 16 * heads * dim * 2
            figures[name] = bench_size(name, max(8, total // size), reps, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for k, v in figures.items():
        print(f"{k:14s} " + "  ".join(f"{a}={b:.3f}" for a, b in v.items()))
    keys = ("shm_load_vs_memcpy", "shm_store_vs_memcpy", "stream_load_vs_memcpy", "stream_store_vs_memcpy",
            "load_vs_redis", "store_vs_redis", "socket_vs_memcpy")
    print(json.dumps({k: round(min(v[k] for v in figures.values()), 3) for k in keys}))


if __name__ == "__main__":
    main()
