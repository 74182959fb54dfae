"""Sessions for agent resumption over a real embedded store and local
manifests: save, resume with the loadable prefix, pin with TTL, list, delete,
and tenants that never see each other's sessions or blocks.
(Shared manifests through Redis and S3: tests/integration/test_directory.py.)"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from cache_service.blocks.keys import prefix_hashes
from cache_service.sessions.manifests import Session, SessionError, SessionManager, SessionStore
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
    mgr.view(tenant).store(NS, hs, [payload_for(h) for h in hs])
    return hs


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
    s = mgr.save("acme", "plan", TOKENS + [999], NS, messages=[{"role": "user", "content": "go"}])
    assert (s.namespace, s.block_tokens) == (NS.fingerprint().hex(), 4)
    # All six full blocks are held: 24 tokens loadable (the trailing partial block never is).
    r = mgr.resume("acme", "plan", NS)
    assert r.session.token_ids == TOKENS + [999] and r.session.messages == [{"role": "user", "content": "go"}]
    assert r.loadable_tokens == 24
    # Lose the fourth block: only the prefix before it counts.
    store.delete(mgr.view("acme").keys(hs[3:4]))
    assert mgr.resume("acme", "plan", NS).loadable_tokens == 12
    # An engine with another layout finds the session but can load none of it.
    other = dataclasses.replace(NS, model_id="another-model")
    assert mgr.resume("acme", "plan", other).loadable_tokens == 0
    assert mgr.resume("acme", "nope", NS) is None


def test_save_writes_the_blocks_below_before_the_manifest(node):
    store, mgr = node
    hs = put_blocks(mgr, "acme", TOKENS)
    mgr.save("acme", "plan", TOKENS, NS)
    # Once save returns, the disk tier (written in the background) holds every block.
    assert store.tiers[1].contains_many(mgr.view("acme").keys(hs)) == [True] * 6


def test_a_pin_keeps_the_session_through_eviction_until_its_ttl(tmp_path):
    store = make_store(tmp_path / "store", cpu_blocks=8, disk_blocks=None)  # one tier: eviction drops
    mgr = SessionManager(store, SessionStore(tmp_path))
    try:
        put_blocks(mgr, "acme", TOKENS)
        s = mgr.save("acme", "plan", TOKENS, NS, pin_ttl_s=0.5)
        assert s.pinned_until > time.time()
        # Sixteen other blocks later the pinned six are all still here.
        put_blocks(mgr, "acme", list(range(5000, 5064)))
        assert mgr.resume("acme", "plan", NS).loadable_tokens == 24
        # After the TTL they are ordinary blocks again, and the next wave evicts them.
        time.sleep(0.6)
        put_blocks(mgr, "acme", list(range(9000, 9064)))
        assert mgr.resume("acme", "plan", NS).loadable_tokens < 24
    finally:
        store.close()


def test_unpin_and_delete(node):
    store, mgr = node
    put_blocks(mgr, "acme", TOKENS)
    mgr.save("acme", "plan", TOKENS, NS)
    assert not mgr.pin("acme", "missing", NS, 60)
    assert mgr.pin("acme", "plan", NS, 60) and mgr.resume("acme", "plan", NS).session.pinned_until > time.time()
    assert mgr.unpin("acme", "plan", NS) and mgr.resume("acme", "plan", NS).session.pinned_until == 0
    with pytest.raises(SessionError):
        mgr.pin("acme", "plan", NS, 0)
    # Delete forgets the manifest; the blocks stay cached for whoever has the same prefix.
    assert mgr.list("acme") == ["plan"]
    assert mgr.delete("acme", "plan", NS) and mgr.list("acme") == []
    assert mgr.view("acme").lookup(prefix_hashes(NS, TOKENS)) == 6


def test_another_tenant_sees_no_session_and_no_block_even_with_the_right_hashes(node):
    store, mgr = node
    hs = put_blocks(mgr, "acme", TOKENS)
    mgr.save("acme", "plan", TOKENS, NS)
    globex = mgr.view("globex")
    # Same hashes, same session id: nothing, whichever way globex asks.
    assert globex.lookup(hs) == 0
    assert globex.load(NS, hs) == [None] * 6
    assert mgr.resume("globex", "plan", NS) is None and mgr.list("globex") == []
    assert store.lookup(hs) == 0  # the store's keys are salted: the raw hashes name nothing
    # Probing destroyed nothing: acme still loads every block intact, nothing was quarantined.
    got = mgr.view("acme").load(NS, hs)
    assert all(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))
    assert all(t["corrupt"] == 0 for t in store.stats().values())
