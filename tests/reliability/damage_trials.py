"""Child process of test_self_healing.py: seeded random damage of an embedded
store (``local://DIR``) between engine runs. Run in its own process so that a
crash (SIGBUS from a mapped index, say) is an exit status, not a lost test run.

    python tests/reliability/damage_trials.py DIR TRIALS SEED [FIRST]   (FIRST: replay from that trial)

Per trial, on a fresh store holding up to 400 blocks of other prompts: run 1 fills the cache; the store's files are
damaged (1-3 kinds drawn from KINDS); run 2 goes over the damaged store (its
loads checked against run 1's blocks); run 3 must load every block run 1
stored (the store healed without a person). Every run is a fresh engine
(tiny-random, fp32) and a fresh store object, and its greedy output is
compared with the engine's without a cache. One JSON line per trial, then
one summary line.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import lmdb
import torch

from connectors.client import connect
from connectors.engine import EngineConnector
from engine import LLM, SamplingParams
from cache_service.blocks.keys import prefix_hashes
from tests.tiers.disk_objects import place_of, read_at, write_at
from tiers.disk_index import bytes_in_use

KINDS = ("flip", "truncate", "zero_fill", "swap", "delete", "index_bytes", "index_truncate", "lock")
TEXT = "A cache that heals itself keeps serving after damage. " * 8 + "What does it keep?"
PARAMS = SamplingParams(max_tokens=8)


class Checked:
    """The store as the engine's client, counting payloads it serves that differ from `originals`."""

    def __init__(self, inner, originals: dict) -> None:
        self.inner, self.originals, self.served, self.wrong = inner, originals, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, ns, hashes):
        got = self.inner.load(ns, hashes)
        for h, g in zip(hashes, got):
            if g is not None and h in self.originals:
                self.served += 1
                self.wrong += not torch.equal(g.contiguous().view(torch.uint8), self.originals[h])
        return got


def run(url: str, prompt: list[int], originals: dict) -> dict:
    """One engine run over the store at `url`."""
    llm = LLM("tiny-random", dtype="float32", kv_cache_bytes=16 << 20)
    client = Checked(connect(url), originals)
    llm.set_kv_connector(EngineConnector(client, llm.kv_namespace(16), llm.page_size))
    out = llm.generate([prompt], PARAMS)[0]
    ns = llm.kv_namespace(16)
    hs = prefix_hashes(ns, prompt)
    if not originals:  # run 1: what it stored is what later runs must serve
        client.inner.flush(60)
        originals.update((h, p.contiguous().view(torch.uint8).clone())
                         for h, p in zip(hs, client.inner.load(ns, hs)) if p is not None)
    client.inner.close()
    return {"tokens": out.token_ids, "cached": out.num_cached_tokens, "served": client.served, "wrong": client.wrong}


def fill(url: str, llm: LLM, n: int) -> None:
    """n blocks of other prompts, so the index spans many pages (branch pages included)."""
    ns, store = llm.kv_namespace(16), connect(url)
    hashes = prefix_hashes(ns, list(range(1000, 1000 + 16 * n)))
    store.store(ns, hashes, [torch.zeros(ns.block_shape, dtype=torch.float32)] * n)
    store.close()


def objects(root: Path) -> list:
    """Where each indexed block's object lies (the index undamaged)."""
    env = lmdb.open(str(root / "index.lmdb"), readonly=True, lock=False, subdir=True)
    with env.begin() as txn:
        hs = [bytes(k) for k, _ in txn.cursor() if len(k) == 16]
    env.close()
    return [p for p in (place_of(root, h) for h in sorted(hs)) if p is not None]


def damage(root: Path, kind: str, rng: random.Random, places: list) -> None:
    """One kind of damage to the closed store at `root` (its objects at `places`)."""
    index = root / "index.lmdb" / "data.mdb"
    f = rng.choice(places) if places else None
    if f and kind in ("flip", "zero_fill") and not read_at(f):
        f = None  # an earlier damage cut its file short before it
    if kind == "flip" and f:
        data = bytearray(read_at(f))
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        write_at(f, bytes(data))
    elif kind == "truncate" and f:  # the segment file cut short inside this object
        os.truncate(f[0], f[1] + rng.randrange(f[2]))
    elif kind == "zero_fill" and f:
        data = bytearray(read_at(f))
        start = rng.randrange(len(data))
        n = rng.randrange(1, len(data) - start + 1)
        data[start:start + n] = bytes(n)
        write_at(f, bytes(data))
    elif kind == "swap" and len(places) > 1:
        a, b = rng.sample(places, 2)
        da, db = read_at(a), read_at(b)
        write_at(a, db)
        write_at(b, da)
    elif kind == "delete" and f:
        write_at(f, None)
    elif kind == "index_bytes":  # within the pages in use (the file extends sparsely past them)
        size = bytes_in_use(index.parent)
        with open(index, "r+b") as fh:
            for _ in range(rng.randrange(1, 8)):
                fh.seek(rng.randrange(size))
                fh.write(rng.randbytes(rng.randrange(1, 512)))
    elif kind == "index_truncate":
        with open(index, "r+b") as fh:
            fh.truncate(rng.randrange(bytes_in_use(index.parent)))
    elif kind == "lock":
        (root / "LOCK").unlink(missing_ok=True)


def main(base: Path, trials: int, seed: int, first: int = 0) -> int:
    torch.set_num_threads(1)
    control = LLM("tiny-random", dtype="float32", kv_cache_bytes=16 << 20)
    prompt = control.apply_chat_template([{"role": "user", "content": TEXT}])
    expected = control.generate([prompt], PARAMS)[0].token_ids
    reference = base / "reference"  # an undamaged store: how much a warm run loads
    run(f"local://{reference}", prompt, {})
    warm = run(f"local://{reference}", prompt, {"-": None})["cached"]
    assert warm > 0, "an undamaged store served nothing"
    totals = {"trials": 0, "wrong": 0, "not_identical": 0, "not_healed": 0, "warm_cached_tokens": warm}
    for t in range(first, first + trials):
        rng = random.Random(seed * 1000 + t)
        root = base / f"trial-{t}"
        shutil.rmtree(root, ignore_errors=True)
        url, originals = f"local://{root}", {}
        fill(url, control, rng.randrange(0, 400))
        first = run(url, prompt, originals)
        kinds = rng.sample(KINDS, rng.randint(1, 3))
        places = objects(root)  # read before any damage: a damaged index is no bystander's to read
        for kind in kinds:
            damage(root, kind, rng, places)
        second, third = run(url, prompt, originals), run(url, prompt, originals)
        healed = third["cached"] == warm
        line = {"trial": t, "kinds": kinds, "cached": [r["cached"] for r in (first, second, third)],
                "wrong": second["wrong"] + third["wrong"],
                "identical": all(r["tokens"] == expected for r in (first, second, third)), "healed": healed}
        print(json.dumps(line), flush=True)
        totals["trials"] += 1
        totals["wrong"] += line["wrong"]
        totals["not_identical"] += not line["identical"]
        totals["not_healed"] += not healed
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(totals), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), *map(int, sys.argv[2:5])))
