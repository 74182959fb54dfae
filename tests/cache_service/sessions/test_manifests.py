"""Sessions for agent resumption over a real embedded store and local
manifests: save, resume with the loadable prefix, pin with TTL, list, delete,
and tenants that never see each other's sessions or blocks (the daemon's
session calls run through the same SessionManager: tests/cache_service/server).
(Shared manifests through Redis and S3: tests/integration/test_directory.py.)"""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from cache_service.blocks.keys import prefix_hashes
from cache_service.sessions.manifests import Session, SessionError, SessionManager, SessionStore
from cache_service.store.pins import EXPIRY_CHECK_S
from tests.cache_service.sessions.tenant_view import TenantView
from tests.cache_service.store.store_helpers import NS, make_store, payload_for, same

TOKENS = list(range(100, 124))  # six blocks of four tokens


@pytest.fixture
def node(tmp_path):
    """(store cpu -> disk, manager with local manifests)."""
    store = make_store(tmp_path / "store")
    yield store, SessionManager(store, SessionStore(tmp_path))
    store.close()


def put_blocks(mgr: SessionManager, tenant: str, tokens: list[int]) -> list:
    """Store the KV of `tokens`' full blocks as `tenant`'s engine would; returns the hashes."""
    hs = prefix_hashes(NS, tokens)
    TenantView(mgr.store, tenant).store(NS, hs, [payload_for(h) for h in hs])
    return hs


def save(mgr: SessionManager, tenant: str, session_id: str, tokens: list[int], **kw) -> Session:
    """Save `tenant`'s session of `tokens`, cached under NS."""
    s = Session(session_id, tenant=tenant, model_id=NS.model_id, namespace=NS.fingerprint().hex(),
                block_tokens=NS.block_tokens, token_ids=list(tokens), messages=kw.pop("messages", []))
    return mgr.save(s, NS, key_tenant=tenant, **kw)


def loadable(mgr: SessionManager, tenant: str, session_id: str, ns=NS) -> int:
    """Tokens of the session the store can load now."""
    return mgr.resume(tenant, session_id, ns, key_tenant=tenant)[1] * ns.block_tokens


def test_manifest_files_round_trip_per_tenant(tmp_path):
    m = SessionStore(tmp_path)
    # Saved, read back, listed per tenant; the empty tenant has its own folder.
    m.put(Session("a-1", tenant="acme", token_ids=[1, 2], messages=[{"role": "user", "content": "x"}]))
    m.put(Session("b-1", token_ids=[3]))
    assert m.get("a-1", "acme").token_ids == [1, 2] and m.get("a-1", "acme").updated_s > 0
    assert (m.list("acme"), m.list(""), m.list("globex")) == (["a-1"], ["b-1"], [])
    assert m.get("a-1") is None and m.get("a-1", "globex") is None
    # Ids that could escape the folder are refused.
    for bad in ("../a-1", "", ".hidden", "a/b"):
        with pytest.raises(SessionError):
            m.get(bad, "acme")
    # A manifest written before block_tokens/pinned_until existed still loads.
    old = dataclasses.asdict(m.get("a-1", "acme"))
    del old["block_tokens"], old["pinned_until"]
    (tmp_path / "sessions" / "acme" / "a-1.json").write_text(json.dumps(old))
    assert m.get("a-1", "acme").block_tokens == 0
    # A damaged one is an error naming the file, not a silent new session.
    (tmp_path / "sessions" / "acme" / "a-1.json").write_text("{not json")
    with pytest.raises(SessionError, match="a-1.json"):
        m.get("a-1", "acme")
    # Delete says whether there was something to delete.
    assert m.delete("b-1") and not m.delete("b-1")


def test_resume_reports_how_much_of_the_session_is_loadable(node):
    store, mgr = node
    hs = put_blocks(mgr, "acme", TOKENS)
    save(mgr, "acme", "plan", TOKENS + [999], messages=[{"role": "user", "content": "go"}])
    # All six full blocks are held: 24 tokens loadable (the trailing partial block never is).
    s, blocks = mgr.resume("acme", "plan", NS, key_tenant="acme")
    assert s.token_ids == TOKENS + [999] and s.messages == [{"role": "user", "content": "go"}]
    assert blocks == 6 and mgr.resume("acme", "plan")[1] == 0  # without a namespace: the manifest only
    # Lose the fourth block: only the prefix before it counts.
    store.delete(TenantView(store, "acme").keys(hs[3:4]))
    assert loadable(mgr, "acme", "plan") == 12
    # An engine with another layout finds the session but can load none of it.
    other = dataclasses.replace(NS, model_id="another-model")
    assert loadable(mgr, "acme", "plan", other) == 0
    assert mgr.resume("acme", "nope", NS) == (None, 0)


def test_a_durable_save_writes_the_blocks_below_before_the_manifest(tmp_path):
    store = make_store(tmp_path / "store")
    mgr = SessionManager(store, SessionStore(tmp_path), durable_timeout_s=60.0)
    try:
        hs = put_blocks(mgr, "acme", TOKENS)
        save(mgr, "acme", "plan", TOKENS)
        # Once save returns, the disk tier (written in the background) holds every block.
        assert store.tiers[1].contains_many(TenantView(store, "acme").keys(hs)) == [True] * 6
    finally:
        store.close()


def test_a_pin_keeps_the_session_through_eviction_until_its_ttl(tmp_path):
    store = make_store(tmp_path / "store", cpu_blocks=8, disk_blocks=None)  # one tier: eviction drops
    mgr = SessionManager(store, SessionStore(tmp_path))
    try:
        put_blocks(mgr, "acme", TOKENS)
        s = save(mgr, "acme", "plan", TOKENS, pin=True, pin_ttl_s=0.5)
        assert s.pinned_until > time.time()
        # Sixteen other blocks later the pinned six are all still here.
        put_blocks(mgr, "acme", list(range(5000, 5064)))
        assert loadable(mgr, "acme", "plan") == 24
        # After the TTL (session pins are swept at most every EXPIRY_CHECK_S) they are ordinary blocks again,
        # and the next wave evicts them.
        time.sleep(0.6 + EXPIRY_CHECK_S)
        put_blocks(mgr, "acme", list(range(9000, 9064)))
        assert loadable(mgr, "acme", "plan") < 24
    finally:
        store.close()


def test_delete_unpins_and_forgets(tmp_path):
    store = make_store(tmp_path / "store", cpu_blocks=8, disk_blocks=None)
    mgr = SessionManager(store, SessionStore(tmp_path))
    try:
        put_blocks(mgr, "acme", TOKENS)
        save(mgr, "acme", "plan", TOKENS, pin=True)  # no ttl: pinned until unpinned
        # Delete forgets the manifest and unpins; the blocks stay cached for whoever has the same prefix.
        assert mgr.list("acme") == ["plan"]
        assert mgr.delete("acme", "plan") and mgr.list("acme") == []
        assert not mgr.delete("acme", "plan")
        assert TenantView(store, "acme").lookup(prefix_hashes(NS, TOKENS)) == 6
        put_blocks(mgr, "acme", list(range(5000, 5064)))  # unpinned: evicted like any other
        assert TenantView(store, "acme").lookup(prefix_hashes(NS, TOKENS)) < 6
    finally:
        store.close()


def test_deleting_a_sub_agent_keeps_its_parents_shared_prefix_pinned(tmp_path):
    store = make_store(tmp_path / "store", cpu_blocks=8, disk_blocks=None)  # one tier: eviction drops
    mgr = SessionManager(store, SessionStore(tmp_path))
    try:
        parent, child = TOKENS[:16], TOKENS[:16] + list(range(500, 508))  # the child forks the parent's 4 blocks
        put_blocks(mgr, "acme", child)
        save(mgr, "acme", "parent", parent, pin=True)
        save(mgr, "acme", "child", child, pin=True)
        # The sub-agent is done: its pin goes, the parent's stays; other traffic fills the tier.
        assert mgr.delete("acme", "child") and store.pins.session_pins("acme") == {"parent": 4}
        put_blocks(mgr, "globex", list(range(9000, 9064)))
        # The parent's blocks were still pinned by its own session: all loadable.
        assert loadable(mgr, "acme", "parent") == 16
    finally:
        store.close()


def test_concurrent_saves_of_one_session_each_land_whole(tmp_path):
    m, errors = SessionStore(tmp_path), []

    def saver(k: int) -> None:
        for i in range(50):
            try:
                m.put(Session("plan", tenant="acme", token_ids=[k, i]))
                assert m.get("plan", "acme") is not None
            except Exception as e:  # noqa: BLE001 (collected: the assertion below names them)
                errors.append(repr(e))

    threads = [threading.Thread(target=saver, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Four daemon workers saving one session: no writer lost its file to another, no reader saw half a manifest.
    assert errors == [] and len(m.get("plan", "acme").token_ids) == 2


def test_another_tenant_sees_no_session_and_no_block_even_with_the_right_hashes(node):
    store, mgr = node
    hs = put_blocks(mgr, "acme", TOKENS)
    save(mgr, "acme", "plan", TOKENS)
    globex = TenantView(store, "globex")
    # Same hashes, same session id: nothing, whichever way globex asks.
    assert globex.lookup(hs) == 0
    assert globex.load(NS, hs) == [None] * 6
    assert mgr.resume("globex", "plan", NS, key_tenant="globex") == (None, 0) and mgr.list("globex") == []
    assert store.lookup(hs) == 0  # the store's keys are salted: the raw hashes name nothing
    # Probing destroyed nothing: acme still loads every block intact, nothing was quarantined.
    got = TenantView(store, "acme").load(NS, hs)
    assert all(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))
    assert all(t["corrupt"] == 0 for t in store.stats().values())


@pytest.mark.parametrize("body, why", [
    ('{"session_id": "plan", "messages": "hi"}', "wrong type"),
    ('{"session_id": "plan", "token_ids": [1, "2"]}', "wrong type"),
    ('{"session_id": "other", "token_ids": [1]}', "session 'other'"),
    ('{"session_id": "plan", "tenant": "globex"}', "tenant 'globex'"),
    ("{not json", "unreadable")])
def test_a_manifest_that_is_not_this_sessions_is_an_error_not_a_session(tmp_path, body, why):
    store = SessionStore(tmp_path)
    store.put(Session("plan", tenant="acme", token_ids=[1]))
    # The file under acme/plan is damaged, or names another session or tenant (a copy, an edit).
    (tmp_path / "sessions" / "acme" / "plan.json").write_text(body)
    # Reading it says so: no traceback, and no write lands on another session's manifest.
    with pytest.raises(SessionError, match=why):
        store.get("plan", "acme")


def test_ids_with_a_trailing_newline_are_refused(tmp_path):
    with pytest.raises(SessionError):
        SessionStore(tmp_path).put(Session("agent-7\n", tenant="acme"))
    with pytest.raises(SessionError):
        SessionStore(tmp_path).put(Session("agent-7", tenant="acme\n"))
