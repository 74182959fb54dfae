"""Damaged cache objects: bit flips, truncation, swapped, deleted and foreign
objects on the disk tier and in S3 (the real gateway). Every damaged object
is a miss (never a wrong block), and the engine's greedy output does not change."""
from __future__ import annotations

import random
import uuid

import pytest
import torch

from cache_service.config import load_config
from cache_service.factory import open_store
from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.blocks.objects import HEADER_SIZE, encode
from connectors.engine import EngineConnector
from engine import LLM, SamplingParams
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, make_store, payload_for, same
from tests.reliability.conftest import figure
from tests.tiers.disk_objects import read_at, write_at

pytestmark = pytest.mark.slow
KINDS = ("flip_payload", "flip_header", "truncate", "swap", "delete", "foreign")
FOREIGN_NS = Namespace("another-model", "bfloat16", num_layers=2, kv_heads=2, head_dim=16, block_tokens=4)
TEXT = ("The cache keeps keys and values of earlier prompts so that a long shared prefix is loaded, "
        "not recomputed. ") * 6 + "Question: what does the cache keep?"


def plan_damage(hs: list, per_kind: int, rng: random.Random) -> dict[bytes, str]:
    """hash -> damage kind; swaps come in pairs (each file gets the other's bytes)."""
    victims = rng.sample(hs, per_kind * (len(KINDS) + 1))
    plan, it = {}, iter(victims)
    for kind in KINDS:
        for _ in range(per_kind * (2 if kind == "swap" else 1)):
            plan[next(it)] = kind
    return plan


def damaged(kind: str, h: bytes, data: bytes, partner: bytes | None, rng: random.Random) -> bytes | None:
    """The bytes that replace block h's object (None: the object is deleted)."""
    buf = bytearray(data)
    if kind == "flip_payload":
        buf[rng.randrange(HEADER_SIZE, len(buf))] ^= 1 << rng.randrange(8)
    elif kind == "flip_header":  # within the fields and the header checksum (the padding carries nothing)
        buf[rng.randrange(0, 88)] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del buf[rng.randrange(1, len(buf)):]
    elif kind == "swap":
        return partner
    elif kind == "delete":
        return None
    elif kind == "foreign":  # a valid object for the same hash, written under another model's layout
        return encode(FOREIGN_NS, h, payload_for(h)).numpy().tobytes()
    return bytes(buf)


def swap_partner(plan: dict, h: bytes) -> bytes | None:
    swaps = [x for x, k in plan.items() if k == "swap"]
    if h not in swaps:
        return None
    i = swaps.index(h)
    return swaps[i + 1] if i % 2 == 0 else swaps[i - 1]


def check_loads(store, hs: list, plan: dict) -> tuple[int, int]:
    """(wrong blocks served, damaged blocks that were not a miss) over one load of every hash."""
    got = store.load(NS, hs)
    wrong = sum(g is not None and not same(g, payload_for(h)) for g, h in zip(got, hs))
    missed = {h for g, h in zip(got, hs) if g is None}
    undetected = len(set(plan) - missed)
    assert missed <= set(plan), "an intact block was lost"
    return wrong, undetected


def test_damaged_disk_files_are_misses(tmp_path):
    rng, hs = random.Random(11), hashes(64)
    root = tmp_path / "store"
    # blocks reach the disk tier (fsynced, indexed); the store closes cleanly
    with make_store(root, cpu_blocks=8) as store:
        store.store(NS, hs, [payload_for(h) for h in hs])
        assert store.flush(60)
        disk = store.tiers[1]
        places = {h: disk.location_of(h) for h in hs}
    # damage files behind the store's back: every kind, several times
    plan = plan_damage(hs, 3, rng)
    original = {h: read_at(places[h]) for h in plan}
    for h, kind in plan.items():
        partner = swap_partner(plan, h)
        new = damaged(kind, h, original[h], original[partner] if partner else None, rng)
        write_at(places[h], new)
    # reopened: every damaged block is a miss, every other block byte-exact
    with make_store(root, cpu_blocks=8) as store:
        # erased slots (no header naming the block) are quarantined by the sweep after open: the held prefix ends before the first
        assert store.tiers[1].swept.wait(60)
        gone = min(hs.index(h) for h, k in plan.items() if k == "delete")
        assert store.lookup(hs) <= gone
        wrong, undetected = check_loads(store, hs, plan)
        corrupt = store.stats()["disk"]["corrupt"]
    quarantined = len(list((root / "quarantine").iterdir()))
    swept = sum(k == "delete" for k in plan.values())  # found by the sweep's header check
    figure("corruption_disk", blocks=len(hs), damaged=len(plan), kinds=len(KINDS), detected=len(plan) - undetected,
           wrong_served=wrong, found_by_sweep=swept, quarantined=quarantined)
    assert wrong == 0 and undetected == 0
    assert corrupt == len(plan) and quarantined == len(plan)  # an erased slot is kept aside too (its zeros)


def s3_tiers(s3_server, bucket: str, prefix: str, **extra) -> dict:
    return {"s3": {"bucket": bucket, "prefix": prefix, "endpoint": s3_server.endpoint, "capacity": "1GiB",
                   "access_key": s3_server.access_key, "secret_key": s3_server.secret_key, **extra}}


def test_damaged_s3_objects_are_misses(s3_server, s3_bucket):
    rng, hs = random.Random(12), hashes(48, start=5000)
    prefix = f"rel-{uuid.uuid4().hex[:8]}"
    tiers = {"cpu": {"capacity": 8 * OBJ, "slot_bytes": OBJ}, **s3_tiers(s3_server, s3_bucket, prefix)}
    cfg = load_config(env={}, overrides={"tiers": tiers})
    # blocks reach S3 through the store (cpu -> s3, write-through)
    with open_store(cfg) as store:
        store.store(NS, hs, [payload_for(h) for h in hs])
        assert store.flush(120)
        keys = {h: store.tiers[1].key_of(h) for h in hs}
    raw = s3_server.client()
    plan = plan_damage(hs, 2, rng)
    original = {h: raw.get_object(Bucket=s3_bucket, Key=keys[h])["Body"].read() for h in plan}
    for h, kind in plan.items():
        partner = swap_partner(plan, h)
        new = damaged(kind, h, original[h], original[partner] if partner else None, rng)
        if new is None:
            raw.delete_object(Bucket=s3_bucket, Key=keys[h])
        else:
            raw.put_object(Bucket=s3_bucket, Key=keys[h], Body=new)
    # a fresh store (another node, say) over the same prefix
    with open_store(cfg) as store:
        wrong, undetected = check_loads(store, hs, plan)
        corrupt = store.stats()["s3"]["corrupt"]
        assert store.flush(60)
    listed = raw.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/quarantine/")["KeyCount"]
    deleted = sum(k == "delete" for k in plan.values())
    figure("corruption_s3", blocks=len(hs), damaged=len(plan), kinds=len(KINDS), detected=len(plan) - undetected,
           wrong_served=wrong, quarantined=listed, corrupt_counted=corrupt)
    assert wrong == 0 and undetected == 0
    assert corrupt == listed == len(plan) - deleted


class Checked:
    """The real store as the engine's client, comparing every payload it hands
    the engine with the one the cold run computed (an observer, not a stand-in)."""

    def __init__(self, store, originals: dict) -> None:
        self.inner, self.originals = store, originals
        self.served = self.wrong = 0

    def lookup(self, hashes):
        return self.inner.lookup(hashes)

    def load(self, ns, hashes):
        got = self.inner.load(ns, hashes)
        for h, g in zip(hashes, got):
            if g is not None:
                self.served += 1
                self.wrong += not torch.equal(g.contiguous().view(torch.uint8), self.originals[h])
        return got

    def store(self, ns, hashes, payloads):
        return self.inner.store(ns, hashes, payloads)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def test_engine_output_is_unchanged_over_a_damaged_cache(tmp_path, s3_server, s3_bucket):
    torch.set_num_threads(1)
    tiers = {"cpu": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path / "disk"), "capacity": "64MiB"},
             **s3_tiers(s3_server, s3_bucket, f"rel-{uuid.uuid4().hex[:8]}")}
    cfg = load_config(env={}, overrides={"tiers": tiers})
    params = SamplingParams(max_tokens=16)
    # control: no cache at all
    control = LLM("tiny-random", dtype="float32", kv_cache_bytes=64 << 20)
    prompt = control.apply_chat_template([{"role": "user", "content": TEXT}])
    expected = control.generate([prompt], params)[0].token_ids
    # a cold engine fills the cache (cpu, disk, S3)
    cold = LLM("tiny-random", dtype="float32", kv_cache_bytes=64 << 20)
    ns = cold.kv_namespace(16)
    hs = prefix_hashes(ns, prompt)
    assert len(hs) >= 6
    with open_store(cfg) as store:
        cold.set_kv_connector(EngineConnector(store, ns, cold.page_size))
        assert cold.generate([prompt], params)[0].token_ids == expected
        assert store.flush(120)
        originals = {h: p.contiguous().view(torch.uint8).clone() for h, p in zip(hs, store.load(ns, hs))}
        disk, s3 = store.tiers[1], store.tiers[2]
        places = {i: disk.location_of(hs[i]) for i in (1, 3)}
    # damage: block 1 on disk only, block 4 in S3 only, block 3 in both (so it must be recomputed)
    raw = s3_server.client()
    for i in (1, 3):
        place = places[i]
        data = bytearray(read_at(place))
        data[-5] ^= 0x10
        write_at(place, bytes(data))
    for i in (3, 4):
        key = s3.key_of(hs[i])
        body = bytearray(raw.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        body[HEADER_SIZE + 3] ^= 0x01
        raw.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    # a warm engine over a fresh store: three blocks loaded, the rest recomputed, the same answer
    warm = LLM("tiny-random", dtype="float32", kv_cache_bytes=64 << 20)
    with open_store(cfg) as store:
        client = Checked(store, originals)
        conn = EngineConnector(client, ns, warm.page_size)
        warm.set_kv_connector(conn)
        out = warm.generate([prompt], params)[0]
        st = store.stats()
    figure("corruption_engine", prompt_blocks=len(hs), damaged_copies=4, cached_tokens=out.num_cached_tokens,
           served=client.served, wrong_served=client.wrong, disk_corrupt=st["disk"]["corrupt"],
           s3_corrupt=st["s3"]["corrupt"], output_identical=out.token_ids == expected)
    assert client.wrong == 0
    assert out.num_cached_tokens == 3 * 16  # blocks 0-2 (block 1 from S3), block 3 recomputed
    assert out.token_ids == expected
