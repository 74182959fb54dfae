"""Our engine through the daemon: `tierkv generate --kv-connector grpc://...` in
real processes, two engines sharing one daemon, an engine killed mid-run, a
daemon restart, and a wrong token."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.daemon_process import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]
DOC = ("The daemon keeps attention keys and values for every engine on the node, so a prompt that one engine "
       "prefilled is loaded by the next one. ") * 5
pytestmark = pytest.mark.slow


def daemon(root: Path, *extra: str) -> DaemonProcess:
    config = (f'[tiers.cpu]\ncapacity = "64MiB"\n\n[tiers.disk]\npath = "{root / "store"}"\n'
              'capacity = "256MiB"\nwrite = "through"\n')
    return DaemonProcess(root, config, "--log-format", "json", *extra).start()


def generate(url: str, prompt: str, *extra: str, token: str | None = None, wait: bool = True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TIERKV_TOKEN", None)
    if token:
        env["TIERKV_TOKEN"] = token
    cmd = [sys.executable, "-m", "engine.cli", "generate", "--model", "tiny-random", "--json", "--prompt", prompt,
           "--kv-connector", url, "--dtype", "float32", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture
def started(tmp_path):
    procs: list[DaemonProcess] = []
    yield procs
    for d in procs:
        d.kill()


def test_engines_share_the_daemon_and_lose_nothing(tmp_path, started):
    d = daemon(tmp_path)
    started.append(d)
    # cold then warm through the daemon: identical greedy output, the prefix loaded
    cold, _ = generate(d.url(), DOC)
    warm, _ = generate(d.url(), DOC)
    assert cold["cached_tokens"] == 0 and warm["cached_tokens"] == (warm["prompt_tokens"] - 1) // 16 * 16
    assert warm["token_ids"] == cold["token_ids"]
    # two engine processes at once, each on its own prompt, both through the one daemon
    a = generate(d.url(), "Engine A asks: " + DOC, wait=False)
    b = generate(d.url(), "Engine B asks: " + DOC, "--kv-connector", d.url("stream"), wait=False)
    for p in (a, b):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    again, _ = generate(d.url("stream"), "Engine A asks: " + DOC)
    assert again["cached_tokens"] > 0
    # an engine killed with SIGKILL mid-generation loses nothing in the daemon
    victim = generate(d.url(), "A long answer please. " + DOC, "--max-tokens", "4000", wait=False)
    time.sleep(3)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    after, _ = generate(d.url(), DOC)
    assert after["cached_tokens"] == warm["cached_tokens"] and after["token_ids"] == cold["token_ids"]
    # the daemon restarts (SIGTERM drain) and still serves the prompt from its disk tier
    assert d.stop() == 0
    d.start()
    restarted, _ = generate(d.url(), DOC)
    assert restarted["cached_tokens"] == warm["cached_tokens"] and restarted["token_ids"] == cold["token_ids"]
    assert restarted["tier_hits"].get("disk", 0) > 0


def test_a_wrong_token_gets_no_cache(tmp_path, started):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("right-token-0123456789 acme\n")
    d = daemon(tmp_path, "--token-file", str(tokens))
    started.append(d)
    # the right token stores and loads
    generate(d.url(), DOC, token="right-token-0123456789")
    ok, _ = generate(d.url(), DOC, token="right-token-0123456789")
    assert ok["cached_tokens"] > 0
    # a wrong token is refused: the engine warns, answers without the cache, and sees nothing
    bad, err = generate(d.url(), DOC, token="wrong-token-0123456789")
    assert bad["cached_tokens"] == 0 and "without the KV cache" in err
    assert bad["token_ids"] == ok["token_ids"]
