"""The S3 tier on a real S3 implementation (Ceph RADOS Gateway from
scripts/servers.sh), under a TieredStore cpu -> disk -> s3 built from config:
sharing blocks across nodes, catching a corrupted object, riding out a
gateway outage, plus what moto cannot show (signatures, multipart, lifecycle)."""
from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from cache_service.config import load_config
from cache_service.factory import open_store
from cache_service.blocks.objects import HEADER_SIZE
from tests.cache_service.store.store_helpers import NS, OBJ, all_same, hashes, write_flushed
from tests.integration.conftest import S3Server, s3_answers, servers
from tiers.s3 import S3Tier
from tiers.types import ConfigError

pytestmark = pytest.mark.slow
MB = 1 << 20


@pytest.fixture
def open_node(s3_server: S3Server, s3_bucket: str, tmp_path):
    """`open_node(name)`: a store cpu -> disk -> s3 with its own local disk
    (one per simulated node), sharing this test's prefix of the bucket."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    stores = []

    def open_node(name: str, cpu_blocks: int = 64):
        tiers = {
            "cpu": {"capacity": cpu_blocks * OBJ, "slot_bytes": OBJ},
            "disk": {"path": str(tmp_path / name), "capacity": 256 * OBJ, "fsync": False},
            "s3": {"bucket": s3_bucket, "prefix": prefix, "endpoint": s3_server.endpoint, "capacity": "1GiB",
                   "access_key": s3_server.access_key, "secret_key": s3_server.secret_key},
        }
        stores.append(open_store(load_config(env={}, overrides={"tiers": tiers})))
        return stores[-1]

    open_node.prefix = prefix
    yield open_node
    for s in stores:
        s.close()


def test_blocks_written_by_one_node_load_on_another(open_node, s3_server, s3_bucket):
    # Node A stores a prompt's blocks; they land in its cpu, disk and in S3.
    a = open_node("a")
    hs = hashes(24)
    write_flushed(a, hs)
    raw = s3_server.client()
    listed = raw.list_objects_v2(Bucket=s3_bucket, Prefix=open_node.prefix + "/")["KeyCount"]
    assert listed == 24
    # Node B has its own (empty) disk: lookup and load go to S3, payloads verified.
    b = open_node("b")
    assert b.lookup(hs) == 24
    got = b.load(NS, hs)
    assert all_same(got, hs)
    st = b.stats()
    assert (st["s3"]["hits"], st["s3"]["corrupt"], st["disk"]["hits"]) == (24, 0, 0)
    # The hits were promoted: B's next load is served locally.
    assert all_same(b.load(NS, hs), hs)
    assert b.stats()["s3"]["hits"] == 24


def test_a_corrupted_object_is_a_quarantined_miss(open_node, s3_server, s3_bucket):
    a = open_node("a")
    hs = hashes(4, start=1000)
    write_flushed(a, hs)
    # Flip one payload byte of one object in S3 behind the tier's back.
    raw, key = s3_server.client(), a.tiers[2].key_of(hs[2])
    body = bytearray(raw.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[HEADER_SIZE + 10] ^= 0xFF
    raw.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    # Another node loads: the damaged block is a miss, counted, and moved aside.
    b = open_node("b")
    got = b.load(NS, hs)
    assert got[2] is None and all_same(got[:2] + got[3:], hs[:2] + hs[3:])
    assert b.stats()["s3"]["corrupt"] == 1
    gone = raw.list_objects_v2(Bucket=s3_bucket, Prefix=key)["KeyCount"]
    aside = raw.list_objects_v2(Bucket=s3_bucket, Prefix=f"{open_node.prefix}/quarantine/{hs[2].hex()}-")
    assert gone == 0 and aside["KeyCount"] == 1
    assert b.lookup(hs) == 2


def test_gateway_outage_keeps_local_hits_and_writes_resume(open_node, s3_server, s3_bucket):
    a = open_node("a")
    before = hashes(8, start=2000)
    write_flushed(a, before)
    remote = open_node("remote-reader", cpu_blocks=16)  # lists `before` at open; holds nothing locally
    stopped = servers("stop", "rgw", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    try:
        assert not s3_answers(s3_server.endpoint)
        # Stores return and local hits are served; S3 writes fail quietly, counted, and are deferred.
        during = hashes(8, start=3000)
        write_flushed(a, during)
        assert all_same(a.load(NS, before + during), before + during)
        st = a.stats()["s3"]
        assert st["errors"] >= 1 and st["deferred"] == 8 and st["dropped"] == 0
        # A node that needs S3 for its blocks gets misses, not exceptions.
        assert remote.load(NS, before) == [None] * 8
        assert remote.stats()["s3"]["errors"] >= 1
    finally:
        started = servers("start", "s3", timeout=300)
    assert started.returncode == 0, started.stderr
    # Gateway back: within the tier's pause, new blocks reach S3 again.
    raw, landed = s3_server.client(), False
    for attempt in range(60):
        after = hashes(2, start=4000 + 10 * attempt)
        write_flushed(a, after)
        if a.tiers[2].contains_many(after) == [True, True]:
            landed = True
            break
        time.sleep(0.5)
    assert landed
    assert raw.head_object(Bucket=s3_bucket, Key=a.tiers[2].key_of(after[0]))["ContentLength"] == OBJ
    # What S3 refused while down reaches it too, written from the local copies.
    deadline = time.monotonic() + 30
    while a.tiers[2].contains_many(during) != [True] * 8 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert a.tiers[2].contains_many(during) == [True] * 8
    assert raw.head_object(Bucket=s3_bucket, Key=a.tiers[2].key_of(during[0]))["ContentLength"] == OBJ
    # The other node reads again once its own pause is over.
    deadline = time.monotonic() + 30
    while not all_same(got := remote.load(NS, before), before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all_same(got, before)


def test_real_signatures_multipart_and_lifecycle(s3_server, s3_bucket):
    # A wrong secret is refused by the gateway: a configuration error at open.
    with pytest.raises(ConfigError):
        S3Tier(s3_bucket, capacity_bytes=MB, endpoint_url=s3_server.endpoint,
               access_key=s3_server.access_key, secret_key="not-the-secret")
    tier = S3Tier(s3_bucket, capacity_bytes=256 * MB, prefix=f"mp-{uuid.uuid4().hex[:8]}",
                  multipart_threshold=8 * MB, **s3_server.tier_kwargs())
    try:
        # 20 MiB goes up in three parts and comes back byte for byte.
        h = os.urandom(16)
        obj = torch.randint(0, 256, (20 * MB,), dtype=torch.uint8)
        assert tier.put_many([h], [obj]) == [True]
        etag = s3_server.client().head_object(Bucket=s3_bucket, Key=tier.key_of(h))["ETag"]
        assert etag.endswith('-3"')
        assert torch.equal(tier.get_many([h])[0], obj)
        # Ceph stores the prefix's expiration rule.
        tier.set_expiration(2)
        rules = s3_server.client().get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]
        mine = [r for r in rules if r["ID"] == f"tierkv-expire-{tier.prefix}"]
        assert len(mine) == 1 and mine[0]["Expiration"]["Days"] == 2
        assert mine[0]["Filter"]["Prefix"] == tier.prefix + "/"
    finally:
        tier.close()
