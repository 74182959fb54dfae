"""The vLLM venv (scripts/vllm-venv.sh) and the environment of vLLM child processes."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import in_ci

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python, made (or updated) by scripts/vllm-venv.sh."""
    venv = Path(os.environ.get("TIERKV_VLLM_VENV", ".venv-vllm"))
    py = (venv if venv.is_absolute() else REPO / venv) / "bin" / "python"
    res = subprocess.run(["bash", str(REPO / "scripts" / "vllm-venv.sh")], cwd=REPO, capture_output=True,
                         text=True, timeout=1800)
    if res.returncode != 0 or not py.exists():
        msg = f"vLLM venv unavailable (scripts/vllm-venv.sh rc={res.returncode}): {res.stdout[-800:]} {res.stderr[-800:]}"
        pytest.fail(msg) if in_ci() else pytest.skip(msg)
    return py


def child_env() -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}-{cpus[-1]}" if cpus[-1] - cpus[0] + 1 == len(cpus) else ",".join(map(str, cpus))
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                VLLM_CPU_OMP_THREADS_BIND=bind, PYTHONPATH=str(REPO))
