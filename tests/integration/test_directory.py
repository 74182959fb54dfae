"""The Redis directory (cache_service/directory/redis_directory.py) under TieredStores, against a real
redis-server and a real 3-node Redis Cluster, with Ceph's S3 behind: where
blocks are, which nodes live, a Redis outage that leaves every store serving
local hits and heals by itself, a Redis that is full, and what a node owes
Redis after either. Shared session manifests: test_directory_sessions.py."""
from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import pytest
import redis

from cache_service.config import load_config
from cache_service.factory import open_sessions
from cache_service.sessions.manifests import Session
from tests.cache_service.store.store_helpers import NS, all_same, hashes, write_flushed
from tests.integration.conftest import fill_up, servers, wait_until
from cache_service.directory.redis_directory import S3, RedisDirectory

pytestmark = pytest.mark.slow


def test_a_block_stored_on_one_node_is_found_through_the_directory_on_another(open_node):
    # Y opens first: its S3 tier lists nothing, so only the directory can tell it about X's blocks.
    y, x = open_node("y"), open_node("x")
    hs = hashes(12)
    write_flushed(x, hs)
    assert y.tiers[-1].contains_many(hs) == [False] * 12
    # X published each block twice: on its disk and in S3.
    assert x.directory.locate_many(hs) == [frozenset({"x", S3})] * 12
    # Y's lookup asks Redis once for the whole batch of misses and finds them in S3.
    asked = y.directory.stats.locates
    assert y.lookup(hs) == 12
    assert y.directory.stats.locates == asked + 1
    # Y loads them byte-identical from S3 and promotes them into its own disk (published too).
    assert all_same(y.load(NS, hs), hs)
    assert y.stats()["s3"]["hits"] == 12
    assert y.flush(60)
    assert y.directory.locate_many(hs) == [frozenset({"x", "y", S3})] * 12
    # Now local: a lookup that hits locally never asks Redis.
    asked = y.directory.stats.locates
    assert y.lookup(hs) == 12
    assert y.directory.stats.locates == asked
    # X deletes four blocks everywhere it can (its tiers and S3): only Y's disk copy stays listed.
    x.delete(hs[:4])
    assert x.flush(60)
    assert x.directory.locate_many(hs[:4]) == [frozenset({"y"})] * 4


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_block_gone_from_the_bucket_leaves_the_directory_at_the_first_miss(open_node, s3_server, s3_bucket):
    y, x = open_node("y"), open_node("x")
    hs = hashes(6, start=700)
    write_flushed(x, hs)
    x.close()  # X's own copies go with it: what is left is in S3
    # Block 3's object expires from the bucket (a lifecycle rule, another node's delete).
    client = s3_server.client()
    key = next(o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
               for o in page.get("Contents", ()) if o["Key"].endswith(hs[3].hex()))
    client.delete_object(Bucket=s3_bucket, Key=key)
    # Y believes the directory once, loads, and finds the object gone: the entry goes with it.
    assert y.lookup(hs) == 6
    got = y.load(NS, hs)
    assert [g is not None for g in got] == [True] * 3 + [False] + [True] * 2
    assert y.directory.flush(10)
    assert y.directory.locate_many(hs[3:4]) == [frozenset()]
    # So lookups stop at the block a load cannot deliver.
    assert y.lookup(hs) == 3


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_blocks_evicted_from_a_disk_are_unpublished(open_node):
    # A disk of four blocks (no S3 below): storing ten evicts the oldest from it.
    x = open_node("x", s3=False, disk_blocks=4)
    hs = hashes(10, start=300)
    for i in range(0, 10, 2):
        write_flushed(x, hs[i:i + 2])
    on_disk = x.tiers[1].contains_many(hs)
    assert 0 < sum(on_disk) < 10
    # The directory lists X for exactly the blocks its disk still holds.
    assert ["x" in loc for loc in x.directory.locate_many(hs)] == on_disk


def test_nodes_register_heartbeat_and_leave(target):
    def directory(node_id, **kw) -> RedisDirectory:
        cluster = [(h, int(p)) for h, _, p in (n.rpartition(":") for n in target.get("cluster", "").split(",") if n)]
        return RedisDirectory(url=target.get("url", ""), cluster_nodes=cluster, node_id=node_id, prefix=prefix,
                              heartbeat_ttl_s=2.0, **kw)

    prefix = f"n-{uuid.uuid4().hex[:8]}"
    reader, a = directory(None), directory("a", endpoint="grpc://10.0.0.1:7600")
    try:
        # A registers with its endpoint; a reader (no node of its own) sees it.
        wait_until(lambda: "a" in reader.nodes(fresh=True))
        assert reader.nodes()["a"]["endpoint"] == "grpc://10.0.0.1:7600"
        # (A counts its registration just after the write the reader saw.)
        wait_until(lambda: a.stats.registrations >= 1)
        assert a.stats.registrations == 1
        # Heartbeats keep the record alive past its TTL.
        time.sleep(3)
        assert "a" in reader.nodes(fresh=True)
        # A clean close deregisters at once.
        a.close()
        assert "a" not in reader.nodes(fresh=True)
    finally:
        a.close()
        reader.close()


def test_a_flush_does_not_wait_for_a_large_disks_re_announcement(redis_url):
    d = RedisDirectory(url=redis_url, node_id="big", prefix=f"f-{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=2.0)
    try:
        wait_until(lambda: d.stats.registrations >= 1)
        # A node re-announces 400,000 blocks (paced: tens of seconds); a live update comes meanwhile.
        disk = d.location_of("disk")
        d.announce(disk, [uuid.uuid4().bytes for _ in range(400_000)])
        d.publish(disk, [b"L" * 16])
        # A flush (a session save makes one first) waits for the live update only.
        assert d.flush(10) and d.locate_many([b"L" * 16]) == [frozenset({disk})]
        assert d._announcing  # the re-announcement goes on behind it
    finally:
        d.close(timeout=0.1)


@pytest.mark.parametrize("target", ["redis"], indirect=True)  # stopping Redis is what is tested
def test_redis_outage_leaves_stores_local_only_and_heals(open_node, caplog):
    y, x = open_node("y"), open_node("x")
    sessions = open_sessions(load_config(env={}, overrides=open_node.config("x")), "/nonexistent", x)
    before = hashes(6, start=500)
    write_flushed(x, before)
    sessions.put(Session("before", tenant="acme", token_ids=[1, 2, 3]))
    assert y.lookup(before) == 6
    caplog.set_level(logging.WARNING, logger="cache_service.directory.redis_directory")
    stop = servers("stop", "redis")
    assert stop.returncode == 0, stop.stderr
    try:
        # X still serves its local blocks and stores new ones; no error reaches the caller.
        assert x.lookup(before) == 6 and all_same(x.load(NS, before), before)
        during = hashes(6, start=900)
        write_flushed(x, during)
        assert x.lookup(during) == 6
        # Y cannot learn of them (its S3 view predates them): a miss, not an error, however often asked.
        for _ in range(50):
            assert y.lookup(during) == 0
        assert not x.directory.available and not y.directory.available
        failed = {k: x.directory.stats.as_dict()[k] + y.directory.stats.as_dict()[k] for k in ("errors", "skipped")}
        assert failed["errors"] >= 2 and failed["skipped"] + failed["errors"] >= 50
        # Sessions are still saved and read: the S3 copy answers.
        sessions.put(Session("during", tenant="acme", token_ids=[4, 5, 6]))
        assert sessions.get("before", "acme").token_ids == [1, 2, 3]
        assert sessions.list("acme") == ["before", "during"]
    finally:
        start = servers("start", "redis")
        assert start.returncode == 0, start.stderr
    # Logged at a bounded rate: far fewer warnings than failures.
    warned = [r for r in caplog.records if r.name == "cache_service.directory.redis_directory" and "failed" in r.getMessage()]
    assert 1 <= len(warned) <= 4
    # Redis is back (empty): within seconds X re-registers and re-publishes its disk and S3
    # blocks, the updates queued during the outage are applied, and Y finds everything.
    wait_until(lambda: y.lookup(before + during) == 12)
    assert x.directory.available and x.directory.stats.reconnects >= 1 and x.directory.stats.registrations >= 2
    # The session written during the outage reaches Redis on X's next session call...
    sessions.list("acme")
    assert y.directory.get_manifest("acme", "during") is not None
    # ...and the one Redis lost is read from S3 on Y and put back.
    on_y = open_sessions(load_config(env={}, overrides=open_node.config("y")), "/nonexistent", y)
    assert y.directory.get_manifest("acme", "before") is None
    assert on_y.get("before", "acme").token_ids == [1, 2, 3]
    assert y.directory.get_manifest("acme", "before") is not None


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_registration_whose_heartbeat_fails_halfway_still_re_announces(open_node, monkeypatch):
    # Y opened first: its S3 listing predates X's blocks, so only the directory tells it of them.
    y, x = open_node("y"), open_node("x")
    hs = hashes(8, start=4242)
    write_flushed(x, hs)
    assert y.lookup(hs) == 8
    # Redis loses X's keys; X's next beat registers it again, then reading the node list times out once.
    calls, read_nodes = [], x.directory._read_nodes
    monkeypatch.setattr(x.directory, "_read_nodes", lambda r: read_nodes(r) if calls or calls.append(1) else
                        (_ for _ in ()).throw(redis.exceptions.TimeoutError("Timeout reading from socket")))
    r = redis.Redis.from_url(open_node.config("x")["directory"]["url"])
    r.delete(*[k for pat in (f"tkv:{x.directory._p[4:]}:*", f"{{tkv:{x.directory._p[4:]}:*") for k in r.scan_iter(match=pat)])
    # X re-announces its disk and S3 blocks all the same, and Y finds them again.
    wait_until(lambda: y.lookup(hs) == 8)
    assert calls


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_entries_of_blocks_still_held_do_not_lapse(open_node):
    # Entries expire after block_ttl_s (3 s here); X re-announces what it holds every half of it.
    y, x = open_node("y", block_ttl_s=3), open_node("x", block_ttl_s=3)
    hs = hashes(8, start=777)
    write_flushed(x, hs)
    assert y.lookup(hs) == 8
    # Twice the TTL later, Y (whose S3 listing predates them) still finds them through the directory.
    time.sleep(6)
    assert y.lookup(hs) == 8


@pytest.mark.parametrize("target", ["redis"], indirect=True)  # a Redis of its own
def test_updates_dropped_while_redis_hung_are_repaired(open_node, own_redis):
    proc, url = own_redis
    y, x = open_node("y", url=url), open_node("x", url=url)
    assert y.lookup(hashes(1, start=9000)) == 0
    # Redis hangs (its data kept) while X stores 60 blocks: X's update queue (40 here) drops the oldest.
    x.directory.queue_limit = 40
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)
        during = hashes(60, start=9100)
        for i in range(0, 60, 4):
            write_flushed(x, during[i:i + 4])
        assert x.directory.stats.dropped > 0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # Once Redis answers, X re-announces everything it holds (its S3 blocks too): Y finds all 60.
    wait_until(lambda: y.lookup(during) == 60)


@pytest.mark.parametrize("target", ["redis"], indirect=True)  # a Redis of its own
def test_redis_full_refuses_writes_but_lookups_go_on(open_node, own_redis):
    proc, url = own_redis
    y, x = open_node("y", url=url), open_node("x", url=url)
    hs = hashes(8, start=5150)
    write_flushed(x, hs)
    assert y.lookup(hs) == 8
    # Redis at maxmemory (noeviction): every write answers OOM; reads still work.
    r = redis.Redis.from_url(url)
    fill_up(r)
    more = hashes(4, start=5200)
    requests = x.directory.stats.requests
    write_flushed(x, more)
    time.sleep(3)  # heartbeats refused meanwhile, tried at their usual pace (every heartbeat_ttl_s / 3)
    assert x.directory.stats.requests - requests < 30
    # Refused requests are counted, yet the directory stays up: Y still finds X's S3 blocks.
    assert x.directory.stats.errors > 0 and x.directory.stats.refused > 0
    assert y.directory.available and y.lookup(hs) == 8
    # Once Redis has room again, updates flow: the refused ones were dropped, not left blocking the queue.
    r.config_set("maxmemory", 0)
    later = hashes(4, start=5300)
    write_flushed(x, later)
    wait_until(lambda: y.lookup(later) == 4)


def test_a_re_announcement_finishes_while_updates_keep_being_dropped(own_redis):
    _, url = own_redis
    # A node holding 20,000 blocks (a second of paced re-announcement), its queue bound low.
    held = [i.to_bytes(4, "little") + bytes(12) for i in range(20_000)]
    d = RedisDirectory(url=url, node_id="n1", prefix=f"a-{uuid.uuid4().hex[:6]}", heartbeat_ttl_s=1.0, queue_limit=600)
    d.on_register(lambda everything: d.announce("n1", held))
    r = redis.Redis.from_url(url)
    try:
        # Bursts past the bound drop updates at every heartbeat (every 1/3 s), on and on...
        deadline = time.monotonic() + 10
        while not all(r.exists(d._block_key(h)) for h in held[-100:]):
            assert time.monotonic() < deadline, "the re-announcement started over at every drop"
            d.publish(S3, [uuid.uuid4().bytes for _ in range(700)])
            time.sleep(0.25)
        # ...and meanwhile the re-announcement, not started over at each drop, reached the holding's tail.
        assert d.stats.dropped > 0
    finally:
        d.close()


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_lookup_asks_the_directory_only_what_it_needs(open_node):
    y, x = open_node("y"), open_node("x")
    hs = hashes(8, start=6100)
    write_flushed(x, hs)
    assert y.lookup(hs) == 8
    # A long prompt whose tail nobody holds: the directory is asked about its first few blocks only.
    cold = hs + hashes(1000, start=7000)
    ask, sizes = y.directory.locate_many, []
    y.directory.locate_many = lambda batch: sizes.append(len(batch)) or ask(batch)
    assert y.lookup(cold) == 8 and sizes == [32]
    # Y's S3 tier in an outage (left alone after failures): a load there would miss, so the lookup says so,
    # without asking the directory at all.
    y.tiers[-1]._outage.trip()
    assert y.lookup(hs) == 0 and sizes == [32]


def test_a_long_backlog_does_not_let_the_nodes_record_expire(own_redis):
    _, url = own_redis
    # a TTL of 2 s: a beat every 0.67 s leaves 1.3 s of slack on a loaded 2-core machine (1 s expired once)
    d = RedisDirectory(url=url, node_id="n1", prefix=f"b-{uuid.uuid4().hex[:6]}", heartbeat_ttl_s=2.0)
    try:
        wait_until(lambda: d.stats.registrations == 1)
        # A backlog that takes 6 s to apply (a slow Redis: 0.2 s a batch), three heartbeat TTLs.
        apply = d._apply
        d._apply = lambda r, batch: time.sleep(0.2) or apply(r, batch)
        d.publish(S3, [uuid.uuid4().bytes for _ in range(512 * 30)])
        # Heartbeats go on between batches: the node never looks dead, never registers again.
        while not d.flush(0.2):
            assert "n1" in d.nodes(fresh=True)
        assert d.stats.registrations == 1 and d.stats.published == 512 * 30
    finally:
        d.close()


def test_the_link_tells_a_refusal_from_an_outage(own_redis):
    from cache_service.directory.redis_link import Link, Refused, Unavailable, make_client
    from cache_service.directory.redis_directory import DirectoryStats

    proc, url = own_redis
    stats = DirectoryStats()
    link = Link(lambda: make_client(url, (), 0.3), stats, 0.5)
    r = redis.Redis.from_url(url)
    # Redis full: a write is refused (Refused), Redis stays up, a read goes through.
    fill_up(r)
    with pytest.raises(Refused):
        link.call(lambda c: c.set("k", "v"), "write")
    assert link.up and link.call(lambda c: c.get("missing"), "read") is None
    r.config_set("maxmemory", 0)
    # Redis hung: the same write times out, an outage (Unavailable, not Refused); Redis is left alone.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(Unavailable) as e:
            link.call(lambda c: c.set("k", "v"), "write")
        assert not isinstance(e.value, Refused) and not link.up
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    link.close()


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_lookup_counts_no_block_of_a_tier_in_an_outage(open_node):
    x = open_node("x")
    hs = hashes(8, start=9100)
    write_flushed(x, hs)
    # Y opens after: its S3 tier lists the blocks itself (no directory needed), and its other tiers lack them.
    y = open_node("y")
    assert y.tiers[-1].contains_many(hs) == [True] * 8 and y.lookup(hs) == 8
    # Y's S3 tier in an outage: loads there miss, and the lookup says as much.
    y.tiers[-1]._outage.trip()
    assert y.lookup(hs) == 0 and y.load(NS, hs) == [None] * 8
