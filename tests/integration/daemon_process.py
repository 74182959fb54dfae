"""`tierkv serve` as a real subprocess, for the integration and reliability suites."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """`python -m engine.cli serve` on a free port with the TOML `config`,
    its output in root/daemon.log. `client_timeout_s` goes into `url()`."""

    def __init__(self, root: Path, config: str, *extra: str, client_timeout_s: float | None = None) -> None:
        self.root, self.extra, self.port = root, extra, free_port()
        root.mkdir(parents=True, exist_ok=True)
        self.config = root / "tierkv.toml"
        self.config.write_text(config)
        self.log = root / "daemon.log"
        self.client_timeout_s = client_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, transport: str = "auto") -> str:
        timeout = f"&timeout={self.client_timeout_s:g}" if self.client_timeout_s else ""
        return f"grpc://{self.address}?transport={transport}{timeout}"

    def start(self, ready_s: float = 60.0) -> "DaemonProcess":
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.cli", "serve", "--config", str(self.config), "--listen", self.address,
                 *self.extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + ready_s
        while self.health() != SERVING:  # ready when health says so
            assert self.proc.poll() is None, f"daemon exited early:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"daemon not ready:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.05)
        return self

    def health(self) -> int | None:
        with grpc.insecure_channel(self.address) as ch:
            try:
                req = health_pb2.HealthCheckRequest(service="tierkv.v1.TierKV")
                return health_pb2_grpc.HealthStub(ch).Check(req, timeout=1).status
            except grpc.RpcError:
                return None

    def rss_kib(self) -> int:
        """Resident memory of the daemon process (VmRSS, KiB)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (drain and flush) and wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL, if still running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
