"""Fixtures giving running real servers: Redis, a Redis Cluster, Ceph's S3.

Each fixture reads ``$TIERKV_SERVERS_DIR/env`` (written by
``scripts/servers.sh``); if its server does not answer, it starts it with the
script. Under CI (``CI=true``) a server that cannot be started fails the test;
elsewhere the test is skipped with the reason. Also: stores with a Redis
directory (`open_node`, over `target`: one Redis or the cluster) and a
redis-server of one test's own (`own_redis`) to stop or fill up.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "servers.sh"
STATE = Path(os.environ.get("TIERKV_SERVERS_DIR", "/tmp/tierkv-servers"))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def servers(cmd: str, target: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``scripts/servers.sh cmd target`` (the first start may install packages)."""
    return subprocess.run(["bash", str(SCRIPT), cmd, target], capture_output=True, text=True, timeout=timeout)


def read_env() -> dict[str, str]:
    """The ``export NAME=value`` lines of the script's env file."""
    try:
        lines = (STATE / "env").read_text().splitlines()
    except FileNotFoundError:
        return {}
    pairs = (ln.removeprefix("export ").split("=", 1) for ln in lines if "=" in ln)
    return {k.strip(): v.strip() for k, v in pairs}


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


def _cluster_answers(nodes: str) -> bool:
    import redis

    host, port = nodes.split(",")[0].split(":")
    try:
        info = redis.Redis(host=host, port=int(port), socket_timeout=2, socket_connect_timeout=2).cluster("info")
    except redis.RedisError:
        return False
    if isinstance(info, dict):  # redis-py parses CLUSTER INFO into a dict
        return info.get("cluster_state") == "ok"
    return "cluster_state:ok" in str(info)


def s3_answers(endpoint: str) -> bool:
    """Any HTTP answer (an anonymous request gets 403 or a bucket list) means up."""
    try:
        urllib.request.urlopen(endpoint, timeout=3).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def _ensure(target: str, var: str, answers: Callable[[str], bool]) -> dict[str, str]:
    """The env file once `target` answers at ``env[var]``; starts it if needed."""
    env = read_env()
    if var in env and answers(env[var]):
        return env
    try:
        run = servers("start", target)
        detail = (run.stdout + run.stderr).strip()[-2000:]
    except (OSError, subprocess.TimeoutExpired) as e:
        run, detail = None, str(e)
    env = read_env()
    if run is not None and run.returncode == 0 and var in env and answers(env[var]):
        return env
    reason = f"scripts/servers.sh start {target} did not give a running server:\n{detail}"
    if in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True, slots=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str

    def client(self):
        """A raw boto3 client on the same endpoint (path-style, as the tier uses)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}))

    def tier_kwargs(self) -> dict[str, str]:
        return dict(endpoint_url=self.endpoint, access_key=self.access_key, secret_key=self.secret_key)


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    """Ceph RADOS Gateway on loopback (started by the script if it is not up)."""
    env = _ensure("s3", "TIERKV_TEST_S3_ENDPOINT", s3_answers)
    return S3Server(env["TIERKV_TEST_S3_ENDPOINT"], env["TIERKV_TEST_S3_ACCESS_KEY"],
                    env["TIERKV_TEST_S3_SECRET_KEY"])


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Server):
    """A bucket of this test session, emptied and removed afterwards."""
    name = f"tierkv-it-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=name)
    yield name
    # Best effort: the gateway may have been stopped by a failed outage test.
    if s3_answers(s3_server.endpoint):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """``redis://127.0.0.1:16379/0``: a single Redis without persistence."""
    return _ensure("redis", "TIERKV_TEST_REDIS_URL", _redis_answers)["TIERKV_TEST_REDIS_URL"]


@pytest.fixture(scope="session")
def redis_cluster_nodes() -> list[tuple[str, int]]:
    """Startup nodes of a 3-master Redis Cluster (for redis-py's RedisCluster)."""
    nodes = _ensure("redis-cluster", "TIERKV_TEST_REDIS_CLUSTER", _cluster_answers)["TIERKV_TEST_REDIS_CLUSTER"]
    return [(h, int(p)) for h, p in (n.split(":") for n in nodes.split(","))]


# ------------------------------------------------------------------ stores and Redis servers of one test

def wait_until(check: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll `check` until it is true; fail the test past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


@pytest.fixture(params=["redis", "redis-cluster"])
def target(request) -> dict:
    """[directory] connection settings: one Redis, or the cluster."""
    if request.param == "redis":
        return {"url": request.getfixturevalue("redis_url")}
    return {"cluster": ",".join(f"{h}:{p}" for h, p in request.getfixturevalue("redis_cluster_nodes"))}


@pytest.fixture
def open_node(target: dict, s3_server: S3Server, s3_bucket: str, tmp_path):
    """`open_node(name, s3=True, disk_blocks=256, **directory)`: a store cpu -> disk [-> s3]
    with the directory, sharing this test's S3 prefix and Redis key prefix."""
    from cache_service.config import load_config
    from cache_service.factory import open_store
    from tests.cache_service.store.store_helpers import OBJ

    prefix, stores = f"d-{uuid.uuid4().hex[:8]}", []

    def config(name: str, s3: bool = True, disk_blocks: int = 256, **directory) -> dict:
        tiers = {"cpu": {"capacity": 64 * OBJ, "slot_bytes": OBJ},
                 "disk": {"path": str(tmp_path / name), "capacity": disk_blocks * OBJ, "fsync": False}}
        if s3:
            tiers["s3"] = {"bucket": s3_bucket, "prefix": prefix, "endpoint": s3_server.endpoint,
                           "capacity": "1GiB", "access_key": s3_server.access_key, "secret_key": s3_server.secret_key}
        return {"tiers": tiers, "directory": target | {"node_id": name, "prefix": prefix, "heartbeat_ttl_s": 2.0} | directory}

    def open_node(name: str, **kw):
        stores.append(open_store(load_config(env={}, overrides=config(name, **kw))))
        return stores[-1]

    open_node.config = config
    yield open_node
    for s in stores:
        s.close()


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own (stopped, filled up: nothing shared is touched): (process, URL)."""
    from tests.integration.daemon_process import free_port

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: _redis_answers(url), 10)
    yield proc, url
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(10)


def fill_up(r) -> None:
    """Redis (a client of a test's own server) at maxmemory, noeviction: writes answer OOM, reads still work."""
    r.config_set("maxmemory", r.info("memory")["used_memory"] + 1)
