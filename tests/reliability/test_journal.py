"""Nothing acknowledged is lost (issue #18), against the real Ceph RADOS
Gateway and Redis:

- blocks stored while S3 is down for 60 s, write-through (daemon A) and
  write-back under disk pressure (daemon B); both daemons SIGKILLed during
  the outage and restarted; once S3 is back every block is in S3 (listed and
  byte-checked with boto3) or, for B, still on its disk: 0 lost;
- Redis restarted empty: another node sees a block held on node X's disk
  again within 10 s, with the directory's default heartbeat.

"Acknowledged durable" here is the daemon's Stats showing the S3 writer's
queue empty and every block either in S3 or in its upload journal (the
daemon has no flush RPC; test_crash.py uses the same kind of checkpoint).
"""
from __future__ import annotations

import time
import uuid

import pytest

from cache_service.blocks.objects import encode
from cache_service.config import load_config
from cache_service.factory import open_store
from connectors.grpc.client import GrpcClient
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tests.reliability.conftest import figure, servers
from tests.reliability.test_outages import until

pytestmark = pytest.mark.slow
BLOCKS, OUTAGE_S = 1000, 60.0


def s3_daemon_config(root, s3, bucket: str, prefix: str, s3_write: str, cpu_blocks: int, disk_blocks: int,
                     journal: str = "64MiB") -> str:
    return (f"[tiers.cpu]\ncapacity = {cpu_blocks * OBJ}\n\n"
            f'[tiers.disk]\npath = "{root / "store"}"\ncapacity = {disk_blocks * OBJ}\nwrite = "through"\n\n'
            f'[tiers.s3]\nbucket = "{bucket}"\nprefix = "{prefix}"\nendpoint = "{s3.endpoint}"\n'
            f'access_key = "{s3.access_key}"\nsecret_key = "{s3.secret_key}"\ncapacity = "1GiB"\n'
            f'write = "{s3_write}"\nretries = 0\nconnect_timeout = 1.0\nread_timeout = 3.0\njournal_bytes = "{journal}"\n')


def listed(client, bucket: str, prefix: str) -> int:
    """How many objects are under `prefix` (a listing, no reads)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(len(p.get("Contents", ())) for p in pages)


def in_s3(client, bucket: str, prefix: str) -> dict[bytes, bytes]:
    """Every block object under `prefix`: hash -> its bytes."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", ()):
            h = bytes.fromhex(o["Key"].rsplit("/", 1)[1])
            out[h] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def durable(c: GrpcClient, write_back: bool) -> dict:
    """Wait until the writers are idle and every block waits in the journal
    (write-back: or is still held by the disk, which sends it to S3 when evicted)."""
    def done() -> bool:
        s = c.stats()
        local = s["disk"]["blocks"] if write_back else 0
        return s["s3"]["queue_depth"] == 0 and s["disk"]["queue_depth"] == 0 and \
            s["s3"]["journal_blocks"] + local == BLOCKS
    assert until(done, 60) is not None, c.stats()
    return c.stats()


def store_past_the_bound(d, hs: list, root) -> dict:
    """Store `hs` into daemon d (S3 down) while watching its journal's file: {limit, max file bytes, refused}."""
    f, seen = root / "store" / "journal.lmdb" / "data.mdb", 0
    with GrpcClient(d.url()) as c:
        for k in range(0, len(hs), 50):
            c.store(NS, hs[k:k + 50], [payload_for(h) for h in hs[k:k + 50]])
            seen = max(seen, f.stat().st_size if f.exists() else 0)
        assert until(lambda: c.stats()["s3"]["queue_depth"] == 0, 60) is not None
        s = c.stats()["s3"]
    seen = max(seen, f.stat().st_size)
    assert s["journal_blocks"] + s["journal_refused"] == len(hs), s
    limit = 1 << 20  # the entries' bound; the file's is a quarter more at this size (room for deletes)
    return {"limit_bytes": limit, "file_limit_bytes": limit + limit // 4, "max_file_bytes": seen,
            "journaled": s["journal_blocks"],
            "refused": s["journal_refused"]}


def test_blocks_stored_during_an_s3_outage_survive_sigkill(daemons, tmp_path, s3_server, s3_bucket):
    prefixes = {m: f"rel-journal-{m}-{uuid.uuid4().hex[:8]}" for m in ("through", "back", "bound")}
    a = daemons(s3_daemon_config(tmp_path / "a", s3_server, s3_bucket, prefixes["through"], "through", 64, 4096),
                name="a").start()
    b = daemons(s3_daemon_config(tmp_path / "b", s3_server, s3_bucket, prefixes["back"], "back", 64, 200),
                name="b").start()
    # C's journal (1 MiB) holds far fewer than the blocks it will be asked to keep: its bound must hold.
    c_ = daemons(s3_daemon_config(tmp_path / "c", s3_server, s3_bucket, prefixes["bound"], "through", 64, 4096,
                                  journal="1MiB"), name="c").start()
    hs = hashes(BLOCKS)
    # S3 goes down; both daemons acknowledge 1,000 blocks each, durable in their disks and journals.
    assert servers("stop", "rgw", timeout=120).returncode == 0
    t0 = time.monotonic()
    try:
        for d in (a, b):
            with GrpcClient(d.url()) as c:
                for k in range(0, BLOCKS, 50):
                    c.store(NS, hs[k:k + 50], [payload_for(h) for h in hs[k:k + 50]])
                durable(c, d is b)
        bound = store_past_the_bound(c_, hashes(2 * BLOCKS, start=10**6), tmp_path / "c")
        journaled = {d: GrpcClient(d.url()).stats()["s3"]["journal_blocks"] for d in (a, b)}
        # Both are SIGKILLed during the outage and restarted: the journals are still there.
        for d in (a, b):
            d.kill()
            d.start()
            with GrpcClient(d.url()) as c:
                assert c.stats()["s3"]["journal_blocks"] == journaled[d]
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t0)))
    finally:
        outage_s = time.monotonic() - t0
        assert servers("start", "s3", timeout=300).returncode == 0
    # S3 is back: the journals drain, and every block is in S3, byte for byte (or, write-back, on B's disk).
    for d in (a, b):
        with GrpcClient(d.url()) as c:
            assert until(lambda: c.stats()["s3"]["journal_blocks"] == 0, 120) is not None, c.stats()
    client = s3_server.client()
    want = {h: bytes(encode(NS, h, payload_for(h)).numpy()) for h in hs}
    through, back = (in_s3(client, s3_bucket, prefixes[m]) for m in ("through", "back"))
    with GrpcClient(b.url()) as c:
        rest = [h for h in hs if h not in back]
        local = sum(g is not None and same(g, payload_for(h)) for g, h in zip(c.load(NS, rest), rest))
        lost_b = c.stats()["s3"]["lost"]
    lost_a = sum(want[h] != through.get(h) for h in hs)
    with GrpcClient(c_.url()) as c:  # C was not killed: what its journal refused still reached S3 from its disk
        assert until(lambda: listed(client, s3_bucket, prefixes["bound"]) == 2 * BLOCKS, 120, every_s=1) is not None
        bound["lost"] = c.stats()["s3"]["lost"]
    wrong_b = sum(want[h] != v for h, v in back.items())
    figure("journal", outage_s=outage_s, through_in_s3=len(through), through_lost=lost_a,
           back_in_s3=len(back), back_on_disk=local, back_lost=BLOCKS - len(back) - local, back_lost_counted=lost_b,
           journaled_a=journaled[a], journaled_b=journaled[b], wrong=wrong_b, **{f"bound_{k}": v for k, v in bound.items()})
    assert lost_a == 0 and len(through) == BLOCKS
    assert wrong_b == 0 and len(back) + local == BLOCKS and lost_b == 0
    assert bound["max_file_bytes"] <= bound["file_limit_bytes"] and bound["refused"] > 0 and bound["lost"] == 0


def test_redis_restarted_empty_sees_a_nodes_disk_again_within_seconds(tmp_path, redis_url):
    def node(name: str):
        tiers = {"cpu": {"capacity": 64 * OBJ, "slot_bytes": OBJ},
                 "disk": {"path": str(tmp_path / name), "capacity": 4096 * OBJ, "fsync": False}}
        prefix = f"rel-heal-{uuid.uuid4().hex[:8]}"
        return open_store(load_config(env={}, overrides={"tiers": tiers, "directory": {
            "url": redis_url, "node_id": f"{name}-{prefix}", "prefix": "rel-heal"}}))

    with node("x") as x, node("y") as y:
        hs = hashes(8, start=7000)
        x.store(NS, hs, [payload_for(h) for h in hs])
        assert x.flush(30)
        seen = lambda: y.directory.locate_many(hs) == [frozenset({x.directory.node_id})] * len(hs)  # noqa: E731
        assert until(seen, 20) is not None
        # Redis restarts with nothing (no persistence): the entries and X's registration are gone.
        assert servers("stop", "redis", timeout=120).returncode == 0
        assert servers("start", "redis", timeout=120).returncode == 0
        t0 = time.monotonic()
        # X notices at its next heartbeat, re-registers and re-announces its disk; Y sees it again.
        healed = until(seen, 30, every_s=0.1)
    figure("directory_heals", seconds_after_redis_back=healed, heartbeat_ttl_s=x.directory.heartbeat_ttl_s,
           started_s=round(time.monotonic() - t0, 1))
    assert healed is not None and healed <= 10.0
