"""Helpers the benchmarks share: the servers they start (ports, readiness, CPU time used), the CPU they run on,
and SmolLM2's store namespace, for which their daemons size their slots."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen | None, what: str, timeout: float = 120.0) -> None:
    """Until something listens on `port`; RuntimeError if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f}s")


def cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_idle(pid: int, timeout: float = 120.0) -> None:
    """Until process `pid` uses under 5% of a core over half a second (its start-up work done)."""
    deadline = time.monotonic() + timeout
    last = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = cpu_seconds(pid)
        if now - last < 0.025:
            return
        last = now
    raise RuntimeError(f"process {pid} still busy after {timeout:.0f}s")


def drop_page_cache(*roots: str | os.PathLike) -> None:
    """fsync and posix_fadvise(DONTNEED) every file under `roots` (files or folders),
    so the next reads come from the device, not from memory."""
    files = [Path(r) for r in roots if Path(r).is_file()]
    files += [Path(d) / f for r in roots if Path(r).is_dir() for d, _, names in os.walk(r) for f in names]
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_line() -> str:
    """The CPU model, core count and the ISA flags that change vLLM's CPU kernels, for a bench's header."""
    with open("/proc/cpuinfo") as f:
        info = f.read().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    isa = [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")]
    return f"{model}, {os.cpu_count()} cpus, {' '.join(isa) or 'no avx2'}"


def smollm2_namespace(dtype: str):
    """SmolLM2-135M's blocks in the store (30 layers, 3 KV heads of 64, 16-token blocks) in `dtype`."""
    from cache_service.blocks.keys import Namespace

    return Namespace("smollm2", dtype, 30, 3, 64, block_tokens=16)
