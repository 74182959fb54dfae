"""Session hints in kv_transfer_params: parsed and checked, then acted on over an embedded store."""
from __future__ import annotations

import pytest

from cache_service.sessions.manifests import Session, SessionManager, SessionStore
from connectors.client import connect
from connectors.prefix import full_blocks
from connectors.session_hints import HintError, SessionHint, SessionKeeper
from tests.cache_service.store.store_helpers import NS, make_store, payload_for


@pytest.mark.parametrize("params, error", [
    ("not an object", "must be an object"),
    ({"tierkv": {"retain_s": 5}}, '"session"'),
    ({"tierkv": {"session": "../etc", "retain_s": 5}}, "session"),
    ({"tierkv": {"session": "a", "retain_s": -1}}, "retain_s"),
    ({"tierkv": {"session": "a", "retain_s": float("inf")}}, "retain_s"),
    ({"tierkv": {"session": "a", "retain_s": float("nan")}}, "retain_s"),
    ({"tierkv": {"session": "a", "retain_s": 10**400}}, "retain_s"),
    ({"tierkv": {"session": "a", "release": "yes"}}, "release"),
    ({"tierkv": {"session": "a", "release": True, "retain_s": 5}}, "together"),
    ({"tierkv": {"session": "a", "keep": 5}}, "unknown keys"),
])
def test_malformed_hints_get_a_clear_error(params, error):
    with pytest.raises(HintError, match=error):
        SessionHint.from_params(params)


def test_requests_without_hints_have_none():
    assert SessionHint.from_params(None) is None
    assert SessionHint.from_params({"other_connector": {"x": 1}}) is None
    assert SessionHint.from_params({"tierkv": {"session": "agent-7", "retain_s": 600}}) == \
        SessionHint("agent-7", retain_s=600)


def test_a_retained_session_is_pinned_recorded_and_released(tmp_path):
    store = make_store(tmp_path, cpu_blocks=64)
    manifests = SessionStore(tmp_path / "m")
    keeper = SessionKeeper(store, NS, manifests, tenant="acme", model_id="m1")
    tokens = list(range(3 * NS.block_tokens + NS.block_tokens // 2))
    keys = full_blocks(NS, tokens)
    store.store(NS, keys, [payload_for(k) for k in keys])
    # A hinted turn pins the conversation's three full blocks and records the manifest.
    done = keeper.finished(SessionHint("agent-7", retain_s=600), tokens, [{"role": "user", "content": "hi"}])
    assert done["pinned_blocks"] == 3 and done["yielded"] == []
    assert store.pins.session_pins("acme") == {"agent-7": 3}
    s = manifests.get("agent-7", "acme")
    assert s.token_ids == tokens and s.pinned_until > 0 and s.namespace == NS.fingerprint().hex()
    # A prefetch of the recorded session finds everything already in the top tier.
    assert keeper.prefetch("agent-7") == 0 and keeper.prefetch("unknown") == 0
    # Release lets the pin go; the blocks stay cached.
    assert keeper.finished(SessionHint("agent-7", release=True), [])["released"] is True
    assert store.pins.session_pins("acme") == {} and store.lookup(keys) == 3
    store.close()


def test_a_released_session_is_not_pinned_again_by_a_resume(tmp_path):
    store = make_store(tmp_path, cpu_blocks=64)
    manifests = SessionStore(tmp_path / "m")
    keeper = SessionKeeper(store, NS, manifests, tenant="acme")
    tokens = list(range(4 * NS.block_tokens))
    keys = full_blocks(NS, tokens)
    store.store(NS, keys, [payload_for(k) for k in keys])
    # Retained for an hour, then released: the manifest no longer asks for a pin.
    keeper.finished(SessionHint("agent-7", retain_s=3600), tokens)
    keeper.finished(SessionHint("agent-7", release=True), [])
    assert manifests.get("agent-7", "acme").pinned_until == 0
    # Any node resuming it (the daemon's ResumeSession) leaves it unpinned.
    s, n = SessionManager(store, manifests).resume("acme", "agent-7", NS, key_tenant=None)
    assert n == 4 and not any(store.pins.is_pinned(k) for k in keys)
    store.close()


def test_a_session_another_model_recorded_is_not_taken_over(tmp_path):
    # model A recorded agent-7; a server running model B gets a hinted request for the same id
    store = connect(f"local://{tmp_path}/store")
    manifests = SessionStore(tmp_path / "manifests")
    manifests.put(Session("agent-7", model_id="A@1111", namespace="aa" * 16, block_tokens=16,
                          messages=[{"role": "user", "content": "A's conversation"}], token_ids=list(range(100))))
    keeper = SessionKeeper(store, NS, manifests, "", "B@2222")
    # the hint is refused (the server reports it in the reply), and A's manifest is left as it was
    with pytest.raises(HintError, match="belongs to model A@1111"):
        keeper.finished(SessionHint("agent-7", retain_s=60), list(range(5, 40)))
    assert manifests.get("agent-7").messages == [{"role": "user", "content": "A's conversation"}]
    # nor is it prefetched for model B; model A's own keeper does prefetch it
    asked = []
    store.prefetch = lambda ns, hashes: asked.append(len(hashes)) or 0
    assert keeper.prefetch("agent-7") == 0 and asked == []
    SessionKeeper(store, NS, manifests, "", "A@1111").prefetch("agent-7")
    assert asked == [100 // NS.block_tokens]
    store.close()


def test_two_tenants_hinting_one_session_id_on_a_daemon_without_auth_keep_their_own_pins(tmp_path):
    from cache_service.config import ServerConfig
    from cache_service.server.daemon import Daemon
    from connectors.grpc.client import GrpcClient

    store = make_store(tmp_path / "store")
    daemon = Daemon(store, ServerConfig(sessions_dir=str(tmp_path / "sessions"), listen="127.0.0.1:0")).start()
    client = GrpcClient(f"grpc://{daemon.address}")
    try:
        def keeper(tenant: str) -> SessionKeeper:  # an engine started with --tenant
            return SessionKeeper(client, NS.with_tenant(tenant), SessionStore(tmp_path / tenant), tenant=tenant,
                                 model_id="m")
        acme, globex = keeper("acme"), keeper("globex")
        # Both retain a conversation under the same session id.
        acme.finished(SessionHint("agent-7", retain_s=600), list(range(40)))
        globex.finished(SessionHint("agent-7", retain_s=600), list(range(100, 140)))
        assert store.pins.stats()["session_pins"] == 2
        # globex's release lets go of its own pin only: acme's conversation stays pinned.
        globex.finished(SessionHint("agent-7", release=True), [])
        assert store.pins.stats()["session_pins"] == 1 and store.pins.stats()["pinned_blocks"] == 40 // NS.block_tokens
    finally:
        client.close()
        daemon.stop(grace_s=0)
