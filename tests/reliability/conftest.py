"""Shared scaffolding of the reliability suite (issue #7).

Each test prints one line ``RELIABILITY <name>: key=value ...`` (run pytest
with ``-s`` to collect them). The real Redis and S3 servers come from the
integration fixtures (``scripts/servers.sh``); daemons run as subprocesses
(`Daemon`), always killed at the end of the test that started them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.conftest import redis_url, s3_bucket, s3_server, servers  # noqa: F401 (fixtures)
from tests.integration.test_daemon import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING


def figure(name: str, **values: object) -> None:
    """Print the test's figure line (the issue asks for one per test)."""
    body = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
    print(f"\nRELIABILITY {name}: {body}", flush=True)


class Daemon:
    """`python -m engine.cli serve` on a free port with a given TOML config."""

    def __init__(self, root: Path, config: str, *extra: str) -> None:
        self.root, self.extra, self.port = root, extra, free_port()
        root.mkdir(parents=True, exist_ok=True)
        self.config = root / "tierkv.toml"
        self.config.write_text(config)
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, transport: str = "auto") -> str:
        return f"grpc://{self.address}?transport={transport}&timeout=20"

    def start(self, ready_s: float = 60.0) -> "Daemon":
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

    def sigkill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (drain and flush) and wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture
def daemons(tmp_path):
    """`daemons(config_text, *cli_args, name=...)`: Daemon objects, all killed afterwards."""
    made: list[Daemon] = []

    def make(config: str, *extra: str, name: str = "d") -> Daemon:
        made.append(Daemon(tmp_path / f"{name}{len(made)}", config, *extra))
        return made[-1]

    yield make
    for d in made:
        d.sigkill()


def cpu_disk_config(root: Path, cpu_bytes: int, disk_bytes: int | str = "64MiB", fsync: bool = True,
                    store: str = "") -> str:
    """TOML of a cpu -> disk (write-through) store rooted at root/store."""
    return (f"[store]\n{store}\n[tiers.cpu]\ncapacity = {cpu_bytes}\n\n"
            f'[tiers.disk]\npath = "{root / "store"}"\ncapacity = "{disk_bytes}"\nwrite = "through"\n'
            f"fsync = {'true' if fsync else 'false'}\n")
