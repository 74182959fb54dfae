"""Bad input: malformed configs (hypothesis-generated) and `tierkv serve`
arguments get one clear error naming the problem, and nothing stored is lost.
Malformed RPCs are covered by the property test in
tests/cache_service/server/test_servicer.py (test_malformed_requests_never_crash_the_daemon_or_lose_blocks)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.config import (Config, CpuConfig, DirectoryConfig, DiskConfig, HbmConfig, S3Config, StoreConfig,
                                  load_config)
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, make_store, payload_for, same
from tests.reliability.conftest import ROOT, cpu_disk_config, figure
from tiers.types import ConfigError

pytestmark = pytest.mark.slow
SECTIONS = {"store": StoreConfig, "directory": DirectoryConfig}
TIERS = {"hbm": HbmConfig, "cpu": CpuConfig, "disk": DiskConfig, "s3": S3Config}
SCALARS = st.one_of(
    st.integers(-3, 2**64), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=8),
    st.sampled_from(["4GiB", "1.5GB", "0", "-1MiB", "12 XB", "lru", "arc", "through", "back", "skip", "wait",
                     "redis://127.0.0.1:1/0", "h:1,h2:x", "", "yes", "auto"]),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))


def table(cls) -> st.SearchStrategy:
    """A table of some of `cls`'s keys (plus, sometimes, an unknown one), with any values."""
    names = [f.name for f in dataclasses.fields(cls)] + ["no_such_key"]
    return st.dictionaries(st.sampled_from(names), SCALARS, max_size=4)


CONFIGS = st.fixed_dictionaries({}, optional={
    "store": st.one_of(table(StoreConfig), SCALARS),
    "directory": st.one_of(table(DirectoryConfig), SCALARS),
    "tiers": st.one_of(st.fixed_dictionaries({}, optional={k: st.one_of(table(c), st.none(), SCALARS)
                                                          for k, c in TIERS.items()}), SCALARS),
    "bogus": SCALARS,
})
seen = {"accepted": 0, "refused": 0}


@pytest.fixture(scope="module", autouse=True)
def fuzz_figure():
    """After this module: the property test's counts as its figure line."""
    yield
    if seen["accepted"] + seen["refused"]:
        figure("bad_config_fuzz", examples=seen["accepted"] + seen["refused"], accepted=seen["accepted"],
               refused_with_config_error=seen["refused"], other_exceptions=0)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(raw=CONFIGS)
def test_any_config_is_accepted_or_refused_with_one_clear_line(raw):
    # a config either validates into typed dataclasses or raises ConfigError: no other exception
    try:
        cfg = load_config(env={}, overrides=raw)
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg.strip() and "Traceback" not in msg
        seen["refused"] += 1
        return
    assert isinstance(cfg, Config)
    seen["accepted"] += 1


def test_an_infinite_integer_is_a_config_error():
    # `queue_depth = inf` is valid TOML; it must be refused by name, not crash
    with pytest.raises(ConfigError, match="queue_depth"):
        load_config(env={}, overrides={"store": {"queue_depth": float("inf")}})


def test_a_nan_duration_is_a_config_error():
    # `nan` passes a `<= 0` check; durations must be finite and positive
    with pytest.raises(ConfigError, match="heartbeat_ttl_s"):
        load_config(env={}, overrides={"directory": {"url": "redis://127.0.0.1:1/0", "heartbeat_ttl_s": float("nan")}})


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_bad_serve_arguments_fail_clearly_and_lose_nothing(tmp_path, daemons):
    # a store with blocks on disk
    hs = hashes(16)
    with make_store(tmp_path / "store") as store:
        store.store(NS, hs, [payload_for(h) for h in hs])
        assert store.flush(60)
    good = cpu_disk_config(tmp_path, 64 * OBJ)
    bad_configs = {
        "unknown key": good + "colour = 'blue'\n",
        "bad size": good.replace('capacity = "64MiB"', 'capacity = "lots"'),
        "bad policy": good + "policy = 'random'\n",
        "not toml": good + "[[[\n",
        "wrong type": good.replace("fsync = true", "fsync = 'sometimes'"),
    }
    cases = []
    for name, text in bad_configs.items():
        (tmp_path / "bad.toml").write_text(text)
        cases.append((name, ("--config", str(tmp_path / "bad.toml"), "--listen", "127.0.0.1:0")))
    (tmp_path / "good.toml").write_text(good)
    cfg = ("--config", str(tmp_path / "good.toml"))
    cases += [("bad listen", (*cfg, "--listen", "nowhere")), ("bad workers", (*cfg, "--workers", "0")),
              ("missing token file", (*cfg, "--token-file", str(tmp_path / "none.txt"))),
              ("tls half", (*cfg, "--tls-cert", str(tmp_path / "c.pem"))), ("bad flag", (*cfg, "--frobnicate")),
              ("bad data port", (*cfg, "--data-port", "x")), ("data port too high", (*cfg, "--data-port", "70000"))]
    # each: exit code 2, a last line that says what is wrong, no traceback
    for name, args in cases:
        done = serve(*args)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        assert done.returncode == 2 and "error:" in last and "Traceback" not in done.stderr, (name, done.stderr)
    # a second daemon on a directory in use is refused; the running one keeps serving
    d = daemons(good, name="owner").start()
    clash = serve(*cfg, "--listen", "127.0.0.1:0")
    assert clash.returncode != 0 and "in use" in clash.stderr and "Traceback" not in clash.stderr, clash.stderr
    assert d.health() is not None
    assert d.stop() == 0
    # everything stored before is still there, byte for byte
    with make_store(tmp_path / "store") as store:
        got = store.load(NS, hs)
    kept = sum(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))
    figure("bad_serve_args", cases=len(cases) + 1, clear_errors=len(cases) + 1, blocks_before=len(hs),
           blocks_after=kept)
    assert kept == len(hs)
