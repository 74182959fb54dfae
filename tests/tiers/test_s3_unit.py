"""S3Tier against moto's S3 server (in process, on a loopback port): key
layout, batched operations, misses, capacity accounting, listing on reopen,
blocks written by another node, outages, multipart, lifecycle, and the store
built from a config with an s3 section. Real-server behaviour (signatures,
restarts, corruption through the store) is in tests/integration/test_s3_tier.py."""
from __future__ import annotations

import os
import socket
import time
import uuid

import boto3
import pytest
import torch

from cache_service.config import load_config
from cache_service.factory import open_store
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tiers.s3 import S3Tier
from tiers.types import CapacityError, ConfigError, TierKVError

from moto import server as moto_server  # a dev dependency: missing is a failure, not a skip
MB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """A moto S3 server that can be stopped and restarted on the same port
    (its buckets live in this process, so they survive a restart)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()

    def start(self) -> None:
        self._server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def client(self):
        return boto3.session.Session().client("s3", endpoint_url=self.url, region_name="us-east-1",
                                              aws_access_key_id="k", aws_secret_access_key="s")


@pytest.fixture(scope="module")
def moto():
    server = Moto()
    yield server
    server.stop()


@pytest.fixture
def make_tier(moto):
    """Tiers on a fresh bucket per test (same bucket for every call in a test)."""
    bucket = f"tkv-{uuid.uuid4().hex[:16]}"
    made: list[S3Tier] = []

    def make(capacity: int = 64 * MB, **kw) -> S3Tier:
        kw = dict(endpoint_url=moto.url, access_key="k", secret_key="s", retries=0) | kw
        made.append(S3Tier(bucket, capacity_bytes=capacity, **kw))
        return made[-1]

    make.bucket = bucket
    yield make
    for t in made:
        t.close()


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def block(h: bytes, size: int = 3000) -> torch.Tensor:
    """Bytes derived from the key, so a returned object can be checked; bytes
    8..24 carry the namespace fingerprint, where a block object's header has it."""
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))
    obj = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    obj[8:24] = torch.tensor(list(NS.fingerprint()), dtype=torch.uint8)
    return obj


def test_round_trip_key_layout_and_misses(make_tier, moto):
    tier = make_tier(prefix="kv/a")
    hs = keys(6)
    assert tier.put_many(hs, [block(h) for h in hs]) == [True] * 6
    # Objects sit under <prefix>/<namespace hex>/<first byte hex>/<hash hex>, byte for byte.
    raw = moto.client()
    for h in hs:
        assert tier.key_of(h) == f"kv/a/{NS.fingerprint().hex()}/{h.hex()[:2]}/{h.hex()}"
        body = raw.get_object(Bucket=make_tier.bucket, Key=tier.key_of(h))["Body"].read()
        assert body == block(h).numpy().tobytes()
    # Reads are fresh 1-D uint8 tensors; an unknown hash is a miss, not an error.
    got = tier.get_many(hs + keys(1))
    assert all(g.dtype == torch.uint8 and g.dim() == 1 and torch.equal(g, block(h)) for g, h in zip(got, hs))
    assert got[-1] is None
    s = tier.stats
    assert (s.hits, s.misses, s.errors, s.blocks, s.bytes_in, s.bytes_out) == (6, 1, 0, 6, 18000, 18000)


def test_batches_with_duplicates_contains_and_delete(make_tier):
    tier = make_tier()
    hs = keys(20)
    # A batch naming a block twice stores it once; putting held blocks again writes nothing.
    assert tier.put_many(hs + hs[:2], [block(h) for h in hs + hs[:2]]) == [True] * 22
    assert tier.put_many(hs[:3], [block(h) for h in hs[:3]]) == [True] * 3
    assert tier.stats.bytes_in == 20 * 3000
    assert tier.contains_many(hs[:2] + keys(2)) == [True, True, False, False]
    # Deleting counts the blocks that were held; they are gone from S3 too.
    assert tier.delete_many(hs[:5] + keys(3)) == 5
    assert tier.contains_many(hs[:6]) == [False] * 5 + [True]
    assert tier.get_many(hs[:5]) == [None] * 5
    assert len(tier.keys()) == 15


def test_capacity_accounting(make_tier):
    tier = make_tier(capacity=10_000)
    a, b, c, d = keys(4)
    # Three 3000-byte objects fit in 10 000 bytes; the fourth does not, until a delete.
    assert tier.put_many([a, b, c], [block(h) for h in (a, b, c)]) == [True] * 3
    assert tier.free_bytes() == 1000
    assert tier.put_many([d], [block(d)]) == [False]
    assert tier.contains_many([d]) == [False]
    tier.delete_many([a])
    assert tier.free_bytes() == 4000
    assert tier.put_many([d], [block(d)]) == [True]
    assert (tier.stats.blocks, tier.stats.used_bytes) == (3, 9000)
    # An object larger than the whole tier can never fit.
    with pytest.raises(CapacityError):
        tier.put_many(keys(1), [block(a, 20_000)])


def test_reopen_lists_blocks_oldest_first(make_tier, moto):
    first = make_tier()
    old, new = keys(4), keys(4)
    first.put_many(old, [block(h) for h in old])
    time.sleep(1.1)  # S3 LastModified has one-second granularity
    first.put_many(new, [block(h, 5000) for h in new])
    # Junk under the prefix (not a block key) is not mistaken for a block.
    moto.client().put_object(Bucket=make_tier.bucket, Key="tierkv/zz/not-a-block", Body=b"x")
    # A tier opened later counts what the listing found: blocks, bytes, oldest first.
    second = make_tier()
    order = second.keys()
    assert set(order[:4]) == set(old) and set(order[4:]) == set(new)
    assert (second.stats.blocks, second.stats.used_bytes) == (8, 4 * 3000 + 4 * 5000)
    assert second.free_bytes() == 64 * MB - 32000
    # A different prefix is a different store.
    assert make_tier(prefix="other").keys() == []


def test_blocks_from_another_node_are_served_but_not_counted(make_tier):
    here, there = make_tier(), make_tier()
    hs = keys(3)
    there.put_many(hs, [block(h) for h in hs])
    # Written after `here` opened: unknown to its lookups, but a read in a
    # namespace the store noted (it does so before every load) finds it.
    assert here.contains_many(hs) == [False] * 3
    assert here.get_many(hs[:1]) == [None]
    here.note_namespace(NS.fingerprint())
    assert torch.equal(here.get_many(hs[:1])[0], block(hs[0]))
    assert here.contains_many(hs) == [True, False, False]
    # refresh() learns the rest from a listing; none of it counts against capacity.
    assert here.refresh() == 2
    assert here.contains_many(hs) == [True] * 3
    assert (here.stats.blocks, here.stats.used_bytes, here.keys()) == (0, 0, [])
    # Deleting from here removes the objects for everyone.
    assert here.delete_many(hs) == 3
    assert there.get_many(hs) == [None] * 3
    assert there.stats.blocks == 0  # a 404 on a block it counted drops it from its view


def test_outage_is_misses_and_failed_writes_then_recovers(moto):
    tier = S3Tier(f"tkv-{uuid.uuid4().hex[:16]}", capacity_bytes=64 * MB, endpoint_url=moto.url,
                  access_key="k", secret_key="s", retries=0, retry_after_s=3.0)
    requests = []
    for client in (tier._client, tier._reader):  # writes, and loads (one try each)
        client.meta.events.register("before-send.s3", lambda **kw: requests.append(kw["request"].method))
    held, later = keys(2), keys(2)
    tier.put_many(held, [block(h) for h in held])
    moto.stop()
    try:
        # Reads miss and writes fail, each counted, nothing raised.
        assert tier.get_many(held) == [None, None]
        assert tier.put_many(later, [block(h) for h in later]) == [False, False]
        assert tier.stats.errors == 4
        # Failed requests leave S3 alone for a while: these calls send nothing.
        sent = len(requests)
        assert tier.get_many(held) == [None, None] and tier.put_many(later[:1], [block(later[0])]) == [False]
        assert len(requests) == sent and tier.stats.errors == 7
        # Lookups answer from what the tier knows, without a request.
        assert tier.contains_many(held + later) == [True, True, False, False]
    finally:
        moto.start()
    # Once the pause is over, S3 is used again.
    deadline = time.monotonic() + 30
    while tier.put_many(later, [block(h) for h in later]) != [True, True] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tier.contains_many(later) == [True, True]
    assert all(torch.equal(g, block(h)) for g, h in zip(tier.get_many(held + later), held + later))
    tier.close()


def test_large_objects_upload_in_parts(make_tier, moto):
    tier = make_tier(multipart_threshold=5 * MB)
    small, big = keys(2)
    objs = [block(small, MB), block(big, 11 * MB)]
    assert tier.put_many([small, big], objs) == [True, True]
    # The multipart object's ETag names its part count (11 MiB in 5 MiB parts = 3).
    raw = moto.client()
    assert raw.head_object(Bucket=make_tier.bucket, Key=tier.key_of(big))["ETag"].endswith('-3"')
    assert "-" not in raw.head_object(Bucket=make_tier.bucket, Key=tier.key_of(small))["ETag"]
    got = tier.get_many([small, big])
    assert torch.equal(got[0], objs[0]) and torch.equal(got[1], objs[1])


def test_quarantine_moves_the_object_aside(make_tier, moto):
    tier = make_tier()
    h = keys(1)[0]
    tier.put_many([h], [block(h)])
    tier.quarantine([h])
    # The block is gone from its key and from the tier's view; a copy waits under quarantine/.
    raw = moto.client()
    listed = [o["Key"] for o in raw.list_objects_v2(Bucket=make_tier.bucket)["Contents"]]
    assert listed == [o for o in listed if o.startswith(f"tierkv/quarantine/{h.hex()}-")] and len(listed) == 1
    assert tier.contains_many([h]) == [False] and tier.stats.blocks == 0
    # The reopen listing does not take quarantined copies for blocks.
    assert make_tier().keys() == []


def test_lifecycle_rule_is_set_per_prefix_and_keeps_other_rules(make_tier, moto):
    a, b = make_tier(prefix="a"), make_tier(prefix="b")
    a.set_expiration(7)
    b.set_expiration(1)
    a.set_expiration(3)  # replaces a's rule, keeps b's
    rules = moto.client().get_bucket_lifecycle_configuration(Bucket=make_tier.bucket)["Rules"]
    got = {r["ID"]: (r["Filter"]["Prefix"], r["Expiration"]["Days"], r["Status"]) for r in rules}
    assert got == {"tierkv-expire-a": ("a/", 3, "Enabled"), "tierkv-expire-b": ("b/", 1, "Enabled")}
    with pytest.raises(ConfigError):
        a.set_expiration(0)


def test_bad_settings_raise_config_errors(moto, make_tier):
    ok = dict(capacity_bytes=MB, endpoint_url=moto.url, access_key="k", secret_key="s")
    for bucket, kw in [("Bad_Name", {}), ("fine-name", {"multipart_threshold": MB}),
                       ("fine-name", {"max_concurrency": 0}), ("fine-name", {"prefix": "/x"}),
                       ("fine-name", {"addressing_style": "sideways"})]:
        with pytest.raises(ConfigError):
            S3Tier(bucket, **(ok | kw))
    # A closed tier refuses work.
    tier = make_tier()
    tier.close()
    with pytest.raises(TierKVError):
        tier.get_many(keys(1))


def test_store_from_config_writes_through_and_another_store_reads(moto, tmp_path):
    bucket = f"tkv-{uuid.uuid4().hex[:16]}"
    s3 = {"bucket": bucket, "endpoint": moto.url, "access_key": "k", "secret_key": "s", "capacity": "1GiB"}

    def config(with_disk: bool):
        tiers = {"cpu": {"capacity": 8 * OBJ, "slot_bytes": OBJ}, "s3": s3}
        if with_disk:
            tiers["disk"] = {"path": str(tmp_path / "disk"), "capacity": 64 * OBJ, "fsync": False}
        return load_config(env={}, overrides={"tiers": tiers})

    # The s3 section builds an S3 tier at the bottom, written through by default.
    store = open_store(config(with_disk=True))
    assert [t.name for t in store.tiers] == ["cpu", "disk", "s3"] and store.modes[2] == "through"
    hs = hashes(12)
    store.store(NS, hs, [payload_for(h) for h in hs])
    assert store.flush(60)
    assert store.tiers[2].contains_many(hs) == [True] * 12
    store.close()
    # A store without the disk tier (another node) gets every block from S3, verified.
    other = open_store(config(with_disk=False))
    assert other.lookup(hs) == 12
    got = other.load(NS, hs)
    assert all(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))
    assert other.stats()["s3"]["hits"] == 12
    other.close()
    # A section without a bucket is a configuration error that names the key.
    with pytest.raises(ConfigError, match="tiers.s3.bucket"):
        load_config(env={}, overrides={"tiers": {"s3": {"capacity": "1GiB"}}})


def test_an_object_of_another_size_than_its_blocks_is_quarantined_unread(make_tier, moto, monkeypatch):
    import tiers.s3_io as s3_io

    tier = make_tier()
    known, unknown = keys(2)
    assert tier.put_many([known], [block(known)]) == [True]
    # Two objects replaced in the bucket: a known block's by 8 MiB, an unknown one's (another node's) too.
    raw = moto.client()
    fp = bytes(block(known)[8:24].tolist()).hex()
    raw.put_object(Bucket=make_tier.bucket, Key=tier.key_of(known), Body=b"\0" * (8 * MB))
    raw.put_object(Bucket=make_tier.bucket, Key=f"tierkv/{fp}/{unknown.hex()[:2]}/{unknown.hex()}",
                   Body=b"\0" * (8 * MB))
    tier.note_namespace(bytes.fromhex(fp), 3000)  # the store loads blocks of this namespace: 3000-byte objects
    allocated = []
    real_empty = s3_io.torch.empty
    monkeypatch.setattr(s3_io.torch, "empty", lambda n, **kw: (allocated.append(n), real_empty(n, **kw))[1])
    # Both are misses, neither body is read into memory, and both are set aside for inspection.
    assert tier.get_many([known, unknown]) == [None, None]
    assert all(n < MB for n in allocated) and tier.stats.corrupt == 2
    names = {o["Key"] for o in raw.list_objects_v2(Bucket=make_tier.bucket)["Contents"]}
    assert all(any(n.startswith(f"tierkv/quarantine/{h.hex()}") for n in names) for h in (known, unknown))
    assert tier.key_of(known) not in names
