"""Model resolution and the weight loader."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import ModelConfig
from engine.model import load_model
from engine.models import resolve_model
from engine.errors import ModelError


def test_tiny_random_is_byte_identical_when_rebuilt(tmp_path, monkeypatch, tiny_path):
    # build the model again in an empty cache dir
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    rebuilt = resolve_model("tiny-random")
    assert rebuilt == tmp_path / "models" / "tiny-random"
    # every file has the same bytes as the session's copy
    names = sorted(p.name for p in tiny_path.iterdir())
    assert names == sorted(p.name for p in rebuilt.iterdir())
    for name in names:
        assert (rebuilt / name).read_bytes() == (tiny_path / name).read_bytes(), name
    # a second resolve reuses it and leaves no temp dirs behind
    assert resolve_model("tiny-random") == rebuilt
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".tiny-random.lock")] == [
        "tiny-random"]


def test_models_live_under_the_stores_cache_root(tmp_path, monkeypatch):
    # without TIERKV_CACHE_DIR, XDG_CACHE_HOME places the models as it places the store
    from tiers.cache_root import default_cache_dir

    monkeypatch.delenv("TIERKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tierkv"
    assert resolve_model("tiny-random") == tmp_path / "xdg" / "tierkv" / "models" / "tiny-random"


def test_unknown_names_and_bad_dirs(tmp_path, tiny_path):
    with pytest.raises(ModelError, match="unknown model 'gpt-17'"):
        resolve_model("gpt-17")
    # a directory without weights names what is missing
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"lacks tokenizer.json, \*.safetensors"):
        resolve_model(tmp_path)
    # a local copy of a model directory resolves to itself
    copy = tmp_path / "copy"
    shutil.copytree(tiny_path, copy)
    assert resolve_model(copy) == copy


def test_config_rejects_other_architectures(tmp_path, tiny_path):
    raw = json.loads((tiny_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(ModelError, match="not a Llama-family"):
        ModelConfig.from_dir(tmp_path)


def test_llama3_rope_scaling_matches_transformers(tiny_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    raw = json.loads((tiny_path / "config.json").read_text())
    ours = ModelConfig.from_dir(tiny_path)
    ours.rope_scaling = scaling
    hf_cfg = LlamaConfig(**{**raw, "rope_parameters": {"rope_theta": raw["rope_theta"], **scaling}})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(ours.inv_freq(), ref, rtol=0, atol=0)


def test_loader_fuses_projections_from_hf_tensors(tiny_path):
    from safetensors.torch import load_file

    cfg = ModelConfig.from_dir(tiny_path)
    model = load_model(tiny_path, cfg, torch.float32, torch.device("cpu"))
    hf = load_file(str(tiny_path / "model.safetensors"))
    # q, k, v are stacked in that order; gate before up
    qkv = model.layers[1].self_attn.qkv_proj.weight
    p = "model.layers.1."
    want = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv, want)
    gate_up = model.layers[2].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([hf["model.layers.2.mlp.gate_proj.weight"],
                                           hf["model.layers.2.mlp.up_proj.weight"]]))


def test_loader_reports_missing_weights(tmp_path, tiny_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_path, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelError, match="layers.0.self_attn.qkv_proj.weight"):
        load_model(tmp_path / "m", ModelConfig.from_dir(tmp_path / "m"), torch.float32, torch.device("cpu"))
