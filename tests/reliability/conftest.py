"""Shared scaffolding of the reliability suite (issue #7).

Each test prints one line ``RELIABILITY <name>: key=value ...`` (run pytest
with ``-s`` to collect them). The real Redis and S3 servers come from the
integration fixtures (``scripts/servers.sh``); daemons run as subprocesses
(`DaemonProcess`), always killed at the end of the test that started them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import redis_url, s3_bucket, s3_server, servers  # noqa: F401 (fixtures)
from tests.integration.daemon_process import ROOT, DaemonProcess  # noqa: F401 (ROOT: for the tests)


def figure(name: str, **values: object) -> None:
    """Print the test's figure line (the issue asks for one per test)."""
    body = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
    print(f"\nRELIABILITY {name}: {body}", flush=True)


@pytest.fixture
def daemons(tmp_path):
    """`daemons(config_text, *cli_args, name=...)`: DaemonProcess objects, all killed afterwards."""
    made: list[DaemonProcess] = []

    def make(config: str, *extra: str, name: str = "d") -> DaemonProcess:
        made.append(DaemonProcess(tmp_path / f"{name}{len(made)}", config, *extra, client_timeout_s=20))
        return made[-1]

    yield make
    for d in made:
        d.kill()


def cpu_disk_config(root: Path, cpu_bytes: int, disk_bytes: int | str = "64MiB", fsync: bool = True,
                    store: str = "") -> str:
    """TOML of a cpu -> disk (write-through) store rooted at root/store."""
    return (f"[store]\n{store}\n[tiers.cpu]\ncapacity = {cpu_bytes}\n\n"
            f'[tiers.disk]\npath = "{root / "store"}"\ncapacity = "{disk_bytes}"\nwrite = "through"\n'
            f"fsync = {'true' if fsync else 'false'}\n")
