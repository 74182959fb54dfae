"""Round trip of a small request/reply and a 32 MiB transfer each way: our
framed Unix socket (cache_service/protocol: FramedServer + SocketClient, the
daemon's same-host socket) vs pyzmq REQ/REP over ipc://. The server runs in
a child process (no shared GIL), one connection, one call at a time.

- small: a 64-byte request answered with a 64-byte reply (median and p99 µs).
- upload: 32 MiB from client to server, read into a preallocated buffer
  (ours: recv_into from the socket; zmq: recv_into, which copies out of
  zmq's own message), answered with a small reply; GB/s.
- download: 32 MiB from server to client, likewise read into a preallocated buffer.

pyzmq is optional (`pip install pyzmq`); without it only ours is measured and
the ratios (`small_rtt_vs_zmq`: ours / theirs, lower is better; `upload_vs_zmq`,
`download_vs_zmq`: ours / theirs, higher is better) are null: no claim.
Usage: python bench/socket_rtt.py [--quick]. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cache_service.protocol.ops import Op  # noqa: E402
from cache_service.protocol.socket_client import SocketClient  # noqa: E402
from cache_service.protocol.socket_server import FramedServer  # noqa: E402

SMALL, BULK = 64, 32 << 20
UP, DOWN, ECHO = Op.STORE, Op.LOAD, 200  # the bench server's ops (200: not in the op table) echoes its body


def serve_framed(path: str) -> None:
    """The framed server: echo, bulk upload into a buffer, bulk download from one."""
    import socket
    buf = bytearray(BULK)

    def dispatch(conn, op, body, peer):
        if op == UP:
            conn.read_into(memoryview(buf))
            return grpc.StatusCode.OK, b"ok", []
        if op == DOWN:
            return grpc.StatusCode.OK, b"", [memoryview(buf)]
        return grpc.StatusCode.OK, body, []

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    server = FramedServer(listener, lambda body: None, dispatch).start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the parent closes our stdin
    server.close(grace_s=1.0)


def serve_zmq(path: str) -> None:
    import zmq
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(f"ipc://{path}")
    buf = bytearray(BULK)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        msg = sock.recv(copy=False)
        kind = bytes(msg.buffer[:1])
        if kind == b"U":  # a two-part message: the tag, then the bulk bytes
            sock.recv_into(buf)
            sock.send(b"ok")
        elif kind == b"D":
            sock.send(buf, copy=False)
        elif kind == b"Q":
            sock.send(b"bye")
            return
        else:
            sock.send(msg, copy=False)


def _child(kind: str, path: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, __file__, "--serve", kind, path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _stats(small: list[float], up: list[float], down: list[float]) -> dict:
    small.sort()
    return {"small_rtt_us_median": round(statistics.median(small) * 1e6, 1),
            "small_rtt_us_p99": round(small[int(len(small) * 0.99) - 1] * 1e6, 1),
            "upload_gbps": round(BULK / statistics.median(up) / 1e9, 2),
            "download_gbps": round(BULK / statistics.median(down) / 1e9, 2)}


def bench_framed(where: str, n_small: int, n_bulk: int) -> dict:
    path = os.path.join(where, "framed.sock")
    p = _child("framed", path)
    try:
        c = SocketClient(path, None, 30.0)
        req, data, into = b"x" * SMALL, bytearray(BULK), bytearray(BULK)
        small, up, down = [], [], []
        for _ in range(n_small):
            t = time.perf_counter()
            c.ask(ECHO, req)
            small.append(time.perf_counter() - t)
        for _ in range(n_bulk):
            t = time.perf_counter()
            c.ask(UP, b"", [memoryview(data)])
            up.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.ask(DOWN, b"")
            c.recv_into(memoryview(into))
            down.append(time.perf_counter() - t)
        c.close()
    finally:
        p.stdin.close()
        p.wait(10)
    return _stats(small, up, down)


def bench_zmq(where: str, n_small: int, n_bulk: int) -> dict:
    import zmq
    path = os.path.join(where, "zmq.sock")
    p = _child("zmq", path)
    try:
        s = zmq.Context.instance().socket(zmq.REQ)
        s.connect(f"ipc://{path}")
        req, data, into = b"x" * SMALL, bytearray(BULK), bytearray(BULK)
        small, up, down = [], [], []
        for _ in range(n_small):
            t = time.perf_counter()
            s.send(req)
            s.recv()
            small.append(time.perf_counter() - t)
        for _ in range(n_bulk):
            t = time.perf_counter()
            s.send(b"U", zmq.SNDMORE)
            s.send(data, copy=False)
            s.recv()
            up.append(time.perf_counter() - t)
            t = time.perf_counter()
            s.send(b"D")
            s.recv_into(into)
            down.append(time.perf_counter() - t)
        s.send(b"Q")
        s.recv()
        s.close(linger=0)
    finally:
        p.stdin.close()
        p.wait(10)
    return _stats(small, up, down)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        (serve_framed if args.serve[0] == "framed" else serve_zmq)(args.serve[1])
        return
    n_small, n_bulk = (2000, 5) if args.quick else (20000, 30)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    out = {"cpu": cpu, "cores": os.cpu_count(), "small_bytes": SMALL, "bulk_bytes": BULK,
           "small_calls": n_small, "bulk_calls": n_bulk}
    with tempfile.TemporaryDirectory(prefix="tierkv-rtt-") as where:
        out["framed_unix"] = bench_framed(where, n_small, n_bulk)
        print("framed unix socket:", out["framed_unix"], flush=True)
        try:
            import zmq
            out["pyzmq_ipc"] = dict(bench_zmq(where, n_small, n_bulk), version=zmq.__version__,
                                    libzmq=zmq.zmq_version())
            print("pyzmq REQ/REP ipc://:", out["pyzmq_ipc"], flush=True)
        except ImportError:
            out["pyzmq_ipc"] = None
    peer = out["pyzmq_ipc"]  # the peer: without it this run makes no claim (no ratio)
    ours = out["framed_unix"]
    out["small_rtt_vs_zmq"] = round(ours["small_rtt_us_median"] / peer["small_rtt_us_median"], 3) if peer else None
    for way in ("upload", "download"):
        out[f"{way}_vs_zmq"] = round(ours[f"{way}_gbps"] / peer[f"{way}_gbps"], 3) if peer else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
