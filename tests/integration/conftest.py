"""Fixtures giving running real servers: Redis, a Redis Cluster, Ceph's S3.

Each fixture reads ``$TIERKV_SERVERS_DIR/env`` (written by
``scripts/servers.sh``); if its server does not answer, it starts it with the
script. Under CI (``CI=true``) a server that cannot be started fails the test;
elsewhere the test is skipped with the reason.
"""
from __future__ import annotations

import os
import subprocess
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
