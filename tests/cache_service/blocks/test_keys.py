"""Block keys: the spec's test vectors, determinism, and the C accelerator."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cache_service.blocks import keys
from cache_service.blocks.keys import Namespace, chain_hashes, prefix_hashes
from tiers.types import ConfigError

SPEC = Path(__file__).resolve().parents[3] / "docs" / "hash-spec.md"


def _vectors() -> dict:
    block = re.search(r"```json\n(.*?)```", SPEC.read_text(), re.S)
    assert block, "docs/hash-spec.md lost its JSON test vectors"
    return json.loads(block.group(1))


def _tokens(spec):
    return list(eval(spec, {"range": range})) if isinstance(spec, str) else spec  # noqa: S307 - our own doc


def test_namespace_fingerprints_match_the_spec():
    # every namespace in the spec hashes to the documented fingerprint
    for case in _vectors()["namespaces"]:
        assert Namespace(**case["namespace"]).fingerprint().hex() == case["fingerprint"]


@pytest.mark.parametrize("accelerated", [True, False])
def test_chains_match_the_spec(monkeypatch, accelerated):
    # with and without the C loop, every documented chain reproduces exactly
    if not accelerated:
        monkeypatch.setattr(keys, "_hashchain", None)
    vec = _vectors()
    fps = [Namespace(**c["namespace"]).fingerprint() for c in vec["namespaces"]]
    for case in vec["chains"]:
        p = case["parent"]
        parent = fps[int(p[2:])] if p.startswith("ns") else bytes.fromhex(p)
        extras = [e.encode() for e in case["extras"]] if "extras" in case else None
        got = chain_hashes(parent, _tokens(case["tokens"]), case["block_tokens"], extras)
        assert [h.hex() for h in got] == case["hashes"]


def test_accelerator_is_built_and_agrees_on_long_prompts(monkeypatch):
    # the C extension is part of the build here; it agrees with Python on random prompts
    assert keys._hashchain is not None, "C hash accelerator missing (apt install libxxhash-dev; pip install -e .)"
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 2**31 - 1, size=4099)
    fast = chain_hashes(bytes(16), toks, 16)
    # a list of Python ints is read straight from the list: small ids (one-digit ints, the fast path),
    # zero, negatives and ids past 2**30 (the general path), mixed within one block
    ids = rng.integers(0, 128_000, size=4099).tolist() + [0, -1, 2**30, 2**30 - 1, -(2**31), 2**31 - 1, 7, 0] * 8
    listed = chain_hashes(bytes(16), ids, 16)
    monkeypatch.setattr(keys, "_hashchain", None)
    assert chain_hashes(bytes(16), toks, 16) == fast and len(fast) == 4099 // 16
    assert chain_hashes(bytes(16), ids, 16) == listed and len(listed) == len(ids) // 16


def test_keys_are_identical_in_another_process():
    # a fresh interpreter (different hash seed) computes the same keys
    code = ("from cache_service.blocks.keys import Namespace, prefix_hashes;"
            "ns=Namespace('m','float16',2,2,8);print(''.join(h.hex() for h in prefix_hashes(ns, range(64))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin"}, cwd=SPEC.parents[1])
    ns = Namespace("m", "float16", 2, 2, 8)
    assert out.stdout.strip() == "".join(h.hex() for h in prefix_hashes(ns, range(64)))


def test_prefix_sharing_and_namespace_separation():
    # two prompts share keys exactly as far as they share full blocks
    ns = Namespace("m", "bfloat16", 4, 2, 16, block_tokens=4)
    a = prefix_hashes(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = prefix_hashes(ns, [1, 2, 3, 4, 5, 6, 7, 0])
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    # any layout field or the tenant changes every key
    for other in (ns.with_tenant("t2"), Namespace("m", "float16", 4, 2, 16, block_tokens=4),
                  Namespace("m", "bfloat16", 4, 2, 16, block_tokens=4, tp_rank=1, tp_world=2)):
        assert not set(prefix_hashes(other, range(8))) & set(prefix_hashes(ns, range(8)))


def test_bad_namespaces_and_tokens_are_rejected():
    # wrong fields name themselves; tokens must fit int32 and be 1-D
    with pytest.raises(ConfigError, match="kv_dtype"):
        Namespace("m", "float64", 1, 1, 1)
    with pytest.raises(ConfigError, match="tp_rank"):
        Namespace("m", "float16", 1, 1, 1, tp_rank=2, tp_world=2)
    with pytest.raises(ValueError, match="int32"):
        chain_hashes(bytes(16), [2**31], 1)
    with pytest.raises(ValueError, match="1-D"):
        chain_hashes(bytes(16), [[1, 2]], 1)


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4.0], [1, 2, 3, 4.7], np.array([1.0, 2.0, 3.0, 4.0])])
@pytest.mark.parametrize("accelerated", [True, False])
def test_float_token_ids_are_refused_not_truncated(monkeypatch, accelerated, tokens):
    # 4.7 read as 4 would give another prompt's hashes: a float id is an error on every path
    if not accelerated:
        monkeypatch.setattr(keys, "_hashchain", None)
    with pytest.raises(ValueError, match="integers"):
        chain_hashes(bytes(16), tokens, 2)


@pytest.mark.parametrize("accelerated", [True, False])
def test_ids_past_the_last_full_block_are_checked_on_every_path(monkeypatch, accelerated):
    # the partial block is not hashed, but an id outside int32 there is the same error the array path gives
    if not accelerated:
        monkeypatch.setattr(keys, "_hashchain", None)
    for tokens in ([1, 2, 3, 4, 2**40], np.array([1, 2, 3, 4, 2**40])):
        with pytest.raises(ValueError, match="int32"):
            chain_hashes(bytes(16), tokens, 2)


def test_a_namespace_has_one_canonical_form():
    # 0.0 for a rank, True for a count: equal to the int namespace, written differently (two fingerprints
    # for one layout, whichever came first in the process)
    with pytest.raises(ConfigError, match="tp_rank"):
        Namespace("m", "float16", 2, 2, 8, tp_rank=0.0)
    with pytest.raises(ConfigError, match="num_layers"):
        Namespace("m", "float16", True, 2, 8)
    # a line break in a field could write other fields' lines: two namespaces, one fingerprint
    with pytest.raises(ConfigError, match="model_revision"):
        Namespace("m", "float16", 2, 2, 8, model_revision="r\ntp_rank=1\ntp_world=2\ncodec=raw\ntenant_salt=A")
    with pytest.raises(ConfigError, match="tenant_salt"):
        Namespace("m", "float16", 2, 2, 8).with_tenant("A\ntp_rank=0")


def test_no_extras_and_an_empty_list_of_extras_differ_alike_on_every_path():
    # extras=[] for tokens with full blocks: one extra per block is missing, on the list path as on the array path
    with pytest.raises(ValueError, match="extras"):
        chain_hashes(bytes(16), [1, 2, 3, 4], 2, extras=[])
    with pytest.raises(ValueError, match="extras"):
        chain_hashes(bytes(16), np.array([1, 2, 3, 4]), 2, extras=[])
