"""A `local://` cache configured by the TOML file `tierkv serve --config`
reads, with the URL's path and parameters over it; and `tierkv generate
--config` using it for the cache and its sessions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from connectors.client import local_config

ROOT = Path(__file__).resolve().parents[2]


def config_file(tmp_path: Path) -> Path:
    f = tmp_path / "tierkv.toml"
    f.write_text(f'[tiers.cpu]\ncapacity = "8MiB"\n\n[tiers.disk]\npath = "{tmp_path / "from-file"}"\n'
                 'capacity = "1MiB"\npolicy = "lru"\n')
    return f


def test_the_file_configures_a_local_cache_and_the_url_overrides_it(tmp_path):
    f = config_file(tmp_path)
    # The file alone: its tiers, sizes and policy.
    cfg = local_config("local://", f)
    assert cfg.tiers.disk.path == str(tmp_path / "from-file") and cfg.tiers.disk.capacity == 1 << 20
    assert cfg.tiers.disk.policy == "lru" and cfg.tiers.cpu.capacity == 8 << 20
    # The URL's path and parameters win over the file; what they do not name stays.
    cfg = local_config(f"local://{tmp_path}/from-url?disk=2MiB", f)
    assert cfg.tiers.disk.path == f"{tmp_path}/from-url" and cfg.tiers.disk.capacity == 2 << 20
    assert cfg.tiers.disk.policy == "lru"
    # No file: a 20 GiB disk tier at the URL's path.
    assert local_config(f"local://{tmp_path}/x").tiers.disk.capacity == 20 << 30


def test_generate_with_a_config_file_stores_where_the_file_says(tmp_path):
    f = config_file(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--model", "tiny-random", "--config", str(f),
                        "--kv-connector", "local://", "--session", "s1", "--prompt", "hello there " * 8,
                        "--max-tokens", "4", "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["prompt_tokens"] > 16
    # The blocks and the session's manifest sit under the file's disk path.
    assert any(p.stat().st_size for p in (tmp_path / "from-file" / "segments").iterdir())
    assert any("s1" in p.name for p in (tmp_path / "from-file").rglob("*"))


def test_cache_urls_that_would_go_somewhere_else_are_refused():
    import pytest

    from connectors.grpc.client import GrpcClient
    from tiers.types import ConfigError, TierKVError
    # local://relative/path dropped "relative" (the store landed in /path): three slashes or none.
    for url in ("local://tmp/x", "local://./cache", "local://~/kv"):
        with pytest.raises(ConfigError, match="three slashes"):
            local_config(url)
    # A port past 65535 is a clear error, not a ValueError out of urllib.
    with pytest.raises(TierKVError, match="1-65535"):
        GrpcClient("grpc://127.0.0.1:99999")
    # An IPv6 address keeps its brackets in the gRPC target (it dialled [::0.1.118.0]:443).
    with pytest.raises(TierKVError) as e:
        GrpcClient("grpc://[::1]:9", connect_timeout_s=0.5)
    assert "[::1]:9" in str(e.value)


def test_cache_url_parameters_without_a_value_are_refused():
    import pytest

    from tiers.types import ConfigError
    for url in ("local:///tmp/x?cpu=", "local:///tmp/x?cpu2GiB"):
        with pytest.raises(ConfigError, match="cpu"):
            local_config(url)
