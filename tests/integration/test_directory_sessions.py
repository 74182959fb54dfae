"""Session manifests shared through the Redis directory (cache_service/sessions/shared.py over
cache_service/directory/redis_sessions.py), against a real redis-server, a real Redis Cluster
and Ceph's S3: kept in S3 with Redis in front, or, without S3, each node's own files with Redis
the shared copy; writes Redis missed or refused (down, hung, full) replayed without undoing
another node's later save."""
from __future__ import annotations

import os
import signal
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import redis

from cache_service.config import load_config
from cache_service.factory import open_sessions
from cache_service.sessions.manifests import Session, SessionStore
from cache_service.sessions.shared import SharedSessionStore
from tests.cache_service.sessions.test_pending_manifests import moto_bucket  # noqa: F401 (a fixture)
from tests.integration.conftest import fill_up, wait_until

pytestmark = pytest.mark.slow


@contextmanager
def nodes_without_s3(url: str, tmp_path: Path, names: str) -> Iterator[list[SharedSessionStore]]:
    """One session store per letter of `names`, as nodes of a deployment with a Redis directory at `url`
    and no S3 (manifests durable in each node's own files, under tmp_path/<letter>); closed at the end."""
    cfg = load_config(env={}, overrides={"directory": {"url": url, "prefix": f"s-{uuid.uuid4().hex[:8]}"}})
    nodes = [open_sessions(cfg, tmp_path / n) for n in names]
    try:
        yield nodes
    finally:
        for node in nodes:
            node.close()


def delete_while_redis_hangs(sessions: SharedSessionStore, proc, session_id: str, tenant: str) -> None:
    """`sessions.delete` while the test's own Redis (`proc`) is stopped: the delete is owed to Redis;
    back once Redis answers again."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        sessions.delete(session_id, tenant)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_until(lambda: sessions.directory.nodes(fresh=True) is not None and sessions.directory.available)


def test_sessions_are_shared_through_redis_and_kept_in_s3(open_node):
    x, y = open_node("x"), open_node("y")
    on_x = open_sessions(load_config(env={}, overrides=open_node.config("x")), "/nonexistent", x)
    on_y = open_sessions(load_config(env={}, overrides=open_node.config("y")), "/nonexistent", y)
    # X saves a pinned session; Y reads it, lists it and sees the pin.
    s = Session("trip-1", tenant="acme", token_ids=list(range(40)), messages=[{"role": "user", "content": "hi"}],
                pinned_until=time.time() + 60)
    on_x.put(s)
    got = on_y.get("trip-1", "acme")
    assert (got.token_ids, got.messages) == (s.token_ids, s.messages)
    assert on_y.list("acme") == ["trip-1"] and on_y.list("globex") == []
    assert on_y.pins("acme") == {"trip-1": pytest.approx(s.pinned_until)}
    # The durable copy in S3 (the source of truth) holds the same manifest.
    assert on_y.durable.get("trip-1", "acme").token_ids == s.token_ids
    assert y.directory.get_manifest("acme", "trip-1") is not None
    # Delete removes it from both.
    assert on_y.delete("trip-1", "acme")
    assert on_x.get("trip-1", "acme") is None and on_x.durable.get("trip-1", "acme") is None
    assert on_x.list("acme") == [] and on_x.pins("acme") == {}


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_stale_redis_copy_never_stands_for_the_session(open_node, tmp_path):
    x = open_node("x")
    durable = SessionStore(tmp_path / "durable")
    shared = SharedSessionStore(x.directory, durable)
    shared.put(Session("plan", tenant="acme", token_ids=[1]))
    # A save of turn 2 reached the durable copy but missed Redis (a restart that kept its data, say).
    old = x.directory.get_manifest("acme", "plan")
    durable.put(Session("plan", tenant="acme", token_ids=[1, 2]))
    # Any node reads turn 2, and Redis's copy is set right.
    assert shared.get("plan", "acme").token_ids == [1, 2]
    assert x.directory.get_manifest("acme", "plan") != old
    # A delete that missed Redis: the session is gone for every reader, and from Redis.
    durable.delete("plan", "acme")
    assert shared.get("plan", "acme") is None and shared.list("acme") == []
    assert x.directory.get_manifest("acme", "plan") is None


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_damaged_manifest_waiting_for_redis_does_not_fail_every_session_call(open_node, tmp_path):
    x = open_node("x")
    durable = SessionStore(tmp_path / "durable")
    shared = SharedSessionStore(x.directory, durable)
    # A save misses Redis (replayed later), and its durable file is damaged meanwhile.
    real = x.directory.put_manifest
    x.directory.put_manifest = lambda *a, **kw: False
    shared.put(Session("plan", tenant="acme", token_ids=[1]))
    x.directory.put_manifest = real
    (tmp_path / "durable" / "sessions" / "acme" / "plan.json").write_text("{not json")
    # Other sessions' calls on this node go on.
    shared.put(Session("other", tenant="acme", token_ids=[2]))
    assert shared.get("other", "acme").token_ids == [2] and "other" in shared.list("acme")


@pytest.mark.parametrize("target", ["redis"], indirect=True)
def test_a_manifest_damaged_in_s3_is_an_error_not_no_session(open_node, tmp_path, moto_bucket):
    from cache_service.sessions.manifests import DamagedManifest
    from cache_service.sessions.shared import PendingManifests, S3Manifests

    moto, cfg = moto_bucket
    shared = SharedSessionStore(open_node("x").directory, PendingManifests(S3Manifests(cfg), SessionStore(tmp_path),
                                                                           retry_s=3600))
    # A manifest damaged in S3 with no copy in Redis is an error: "no session" would start it over.
    moto.client().put_object(Bucket=cfg.bucket, Key=f"{cfg.prefix}-sessions/acme/broken.json", Body=b"{not json")
    with pytest.raises(DamagedManifest):
        shared.get("broken", "acme")
    # With a copy in Redis, that copy is read.
    shared.put(Session("kept", tenant="acme", token_ids=[1, 2]))
    moto.client().put_object(Bucket=cfg.bucket, Key=f"{cfg.prefix}-sessions/acme/kept.json", Body=b"{not json")
    assert shared.get("kept", "acme").token_ids == [1, 2]
    shared.durable.close()


def test_without_s3_manifests_stay_on_the_node_that_wrote_them(tmp_path, redis_url):
    # No S3 tier: the durable copy is local files; Redis still shares them.
    with nodes_without_s3(redis_url, tmp_path, "ab") as (a, b):
        a.put(Session("local-1", tenant="acme", token_ids=[7]))
        assert isinstance(a.durable, SessionStore) and a.durable.get("local-1", "acme") is not None
        assert b.get("local-1", "acme").token_ids == [7] and b.durable.get("local-1", "acme") is None


def test_a_save_redis_refuses_is_read_back_from_this_nodes_copy(tmp_path, own_redis):
    _, url = own_redis
    # No S3: the durable copy is this node's files, and Redis's copy is read first.
    with nodes_without_s3(url, tmp_path, "a") as (sessions,):
        sessions.put(Session("turns", tenant="acme", token_ids=[1]))
        # Redis fills up; the next turn's save lands on disk, and Redis refuses its copy.
        r = redis.Redis.from_url(url)
        fill_up(r)
        sessions.put(Session("turns", tenant="acme", token_ids=[1, 2, 3]))
        # This node reads its own newer copy back, not Redis's older one.
        assert sessions.directory.available and sessions.get("turns", "acme").token_ids == [1, 2, 3]
        # Once Redis has room, the save reaches it at the next session call.
        r.config_set("maxmemory", 0)
        sessions.list("acme")
        assert Session.from_json(r.get(sessions.directory._tenant_key("acme", "s:turns")), "redis",
                                 ("turns", "acme")).token_ids == [1, 2, 3]


def test_a_replayed_save_never_overwrites_a_later_one_from_another_node(tmp_path, own_redis):
    _, url = own_redis
    r = redis.Redis.from_url(url)
    with nodes_without_s3(url, tmp_path, "ab") as (a, b):
        a.put(Session("chat", tenant="acme", token_ids=[1]))
        # Redis full: A's next turn is saved on A's disk only, waiting to be replayed into Redis.
        fill_up(r)
        a.put(Session("chat", tenant="acme", token_ids=[1, 2]))
        r.config_set("maxmemory", 0)
        # B saves a later turn; then A's next session call replays what it owed, and must not win.
        time.sleep(0.01)
        b.put(Session("chat", tenant="acme", token_ids=[1, 9]))
        a.list("acme")
        assert b.get("chat", "acme").token_ids == [1, 9] and a.get("chat", "acme").token_ids == [1, 9]


def test_list_agrees_with_get_about_a_delete_redis_missed(tmp_path, own_redis):
    proc, url = own_redis
    r = redis.Redis.from_url(url)
    with nodes_without_s3(url, tmp_path, "a") as (a,):
        a.put(Session("s1", tenant="acme", token_ids=[1]))
        a.put(Session("s2", tenant="acme", token_ids=[2]))
        # A save Redis refuses waits first in line; then a delete misses Redis (it hangs a moment).
        fill_up(r)
        a.put(Session("s1", tenant="acme", token_ids=[1, 1]))
        delete_while_redis_hangs(a, proc, "s2", "acme")
        # Redis still refuses the save, so neither is replayed: list and get both say s2 is gone.
        assert a.list("acme") == ["s1"] and a.get("s2", "acme") is None
        assert a.get("s1", "acme").token_ids == [1, 1]


def test_a_replayed_delete_never_removes_a_later_save_from_another_node(tmp_path, own_redis):
    proc, url = own_redis
    with nodes_without_s3(url, tmp_path, "abc") as (a, b, c):
        a.put(Session("chat", tenant="acme", token_ids=[1]))
        # A deletes the session while Redis hangs: the delete is owed to Redis.
        delete_while_redis_hangs(a, proc, "chat", "acme")
        # B starts the session again; A's next session call replays its delete, which must not undo B's save.
        time.sleep(0.01)
        b.put(Session("chat", tenant="acme", token_ids=[7, 7]))
        a.list("acme")
        assert c.get("chat", "acme").token_ids == [7, 7] and c.list("acme") == ["chat"]


def test_a_delete_that_waited_on_redis_yields_to_a_save_made_meanwhile(tmp_path, own_redis, monkeypatch):
    _, url = own_redis
    with nodes_without_s3(url, tmp_path, "abc") as (a, b, c):
        a.put(Session("chat", tenant="acme", token_ids=[1]))
        # A's delete waits on Redis until it times out; meanwhile B starts the session again.
        def times_out(tenant: str, sid: str):
            b.put(Session(sid, tenant=tenant, token_ids=[7, 7]))
            return None
        monkeypatch.setattr(a.directory, "delete_manifest", times_out)
        a.delete("chat", "acme")
        monkeypatch.undo()
        # A's replay of its delete yields to B's save, made after the delete was.
        a.list("acme")
        assert c.get("chat", "acme").token_ids == [7, 7]
