"""`tierkv serve-engine` as a real subprocess, and the official `openai` client pointed at it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from tests.integration.daemon_process import free_port

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 300  # model load + warm-up on a busy 2-core machine


def wait_healthy(base_url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until an OpenAI-compatible server (ours or vLLM's) answers /health; AssertionError with its log's tail
    if it exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            urllib.request.urlopen(base_url + "/health", timeout=5).close()
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise AssertionError(f"server not healthy in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


class EngineServer:
    """A serve-engine process on a free port; its output goes to `log`."""

    def __init__(self, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port, self.log = free_port(), log
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve-engine", "--port", str(self.port),
                                          *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        self._wait_healthy()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=30) as r:
            return r.read().decode()

    def post(self, path: str) -> str:
        req = urllib.request.Request(self.base_url + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read().decode()

    def post_json(self, path: str, body: dict) -> tuple[int, str]:
        """(status, body) of a POST of `body` as JSON (ASCII-escaped, as any client may send it)."""
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def _wait_healthy(self) -> None:
        try:
            wait_healthy(self.base_url, self.proc, self.log, START_TIMEOUT_S)
        except AssertionError:
            self.close()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
