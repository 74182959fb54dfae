"""Session manifests during an S3 outage: S3 is their source of truth, so a
manifest S3 refuses is kept in durable local files, read from there while it
waits, and uploaded by the background retry once S3 answers (moto's S3
server, stopped and restarted on the same port)."""
from __future__ import annotations

import uuid

import pytest

from cache_service.config import S3Config
from cache_service.sessions.manifests import Session, SessionError, SessionStore
from cache_service.sessions.shared import PendingManifests, S3Manifests
from tests.cache_service.store.store_helpers import until
from tests.tiers.test_s3_unit import Moto


@pytest.fixture
def moto_bucket():
    """(moto's S3 server, the config of a fresh bucket on it); the server is stopped at the end."""
    moto = Moto()
    bucket = f"sessions-{uuid.uuid4().hex[:8]}"
    moto.client().create_bucket(Bucket=bucket)
    yield moto, S3Config(bucket=bucket, capacity=1 << 30, endpoint=moto.url, access_key="k", secret_key="s",
                         retries=0, connect_timeout=0.5, read_timeout=1.0)
    moto.stop()


@pytest.fixture
def by_hand(tmp_path, moto_bucket):
    """(moto, its bucket's config, PendingManifests over it whose retries the test runs by hand)."""
    moto, cfg = moto_bucket
    manifests = PendingManifests(S3Manifests(cfg), SessionStore(tmp_path), retry_s=3600)
    yield moto, cfg, manifests
    manifests.close()


def test_a_manifest_saved_while_s3_is_down_reaches_it_afterwards(tmp_path, moto_bucket):
    moto, cfg = moto_bucket
    s3 = S3Manifests(cfg)
    manifests = PendingManifests(s3, SessionStore(tmp_path), retry_s=0.2)
    try:
        manifests.put(Session("before", tenant="acme", token_ids=[1, 2]))
        # S3 goes down: a save is still acknowledged, written to local files.
        moto.stop()
        manifests.put(Session("during", tenant="acme", token_ids=[3, 4, 5]))
        assert (tmp_path / "sessions" / "acme" / "during.json").exists()
        # While it waits it is read and listed from there.
        assert manifests.get("during", "acme").token_ids == [3, 4, 5]
        assert "during" in manifests.local.list("acme")
        # S3 answers again: the retry uploads it, and the local copy goes.
        moto.start()
        assert until(lambda: not manifests.local.list("acme"), 20)
        assert s3.get("during", "acme").token_ids == [3, 4, 5]
        assert manifests.list("acme") == ["before", "during"]
    finally:
        manifests.close()


def test_a_waiting_manifest_never_overwrites_a_newer_save_from_another_node(by_hand):
    moto, cfg, here = by_hand
    other = S3Manifests(cfg)
    # S3 is down when this node saves turn 1: it waits on local disk.
    moto.stop()
    here.put(Session("plan", tenant="acme", token_ids=[1]))
    moto.start()
    # Another node saves turn 2 once S3 is back; then this node's retry comes.
    other.put(Session("plan", tenant="acme", token_ids=[1, 2]))
    assert here.upload_pending() == 0
    # Turn 2 stands; the stale waiting copy is gone.
    assert other.get("plan", "acme").token_ids == [1, 2] and here.local.list("acme") == []


def test_a_damaged_waiting_manifest_is_set_aside_and_the_others_still_go(tmp_path, by_hand):
    moto, cfg, manifests = by_hand
    # Two saves wait through an outage; one of their files is damaged meanwhile.
    moto.stop()
    manifests.put(Session("a-broken", tenant="acme", token_ids=[1]))
    manifests.put(Session("b-fine", tenant="acme", token_ids=[4, 5, 6]))
    (tmp_path / "sessions" / "acme" / "a-broken.json").write_text("{not json")
    # S3 answers: the damaged one is moved aside, the other uploaded (it was stuck behind it).
    moto.start()
    assert manifests.upload_pending() == 0
    assert S3Manifests(cfg).get("b-fine", "acme").token_ids == [4, 5, 6]
    assert list((tmp_path / "sessions" / "acme").glob("a-broken.json.damaged-*"))


def test_a_delete_during_an_outage_keeps_the_newer_waiting_manifest(by_hand):
    moto, _, manifests = by_hand
    manifests.put(Session("plan", tenant="acme", token_ids=[1]))
    # S3 goes down; turn 2 waits locally; a delete then fails (S3 cannot take it).
    moto.stop()
    manifests.put(Session("plan", tenant="acme", token_ids=[1, 2]))
    with pytest.raises(SessionError):
        manifests.delete("plan", "acme")
    # The session was not deleted, and it did not go back to turn 1.
    moto.start()
    assert manifests.upload_pending() == 0 and manifests.get("plan", "acme").token_ids == [1, 2]
