"""Llama decoder in torch, loaded straight from Hugging Face safetensors.

RMSNorm, RoPE (rotate-half, HF weight layout), grouped-query attention over
the paged KV cache, SwiGLU MLP, optional tied embeddings. q/k/v and gate/up
projections are fused into one matmul each; the loader fills the fused weights
from the separate HF tensors.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.errors import ModelError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference implementation does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] in x's dtype."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, (self.hq + 2 * self.hkv) * self.dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.hq * self.dim, self.hkv * self.dim, self.hkv * self.dim], -1)
        q = apply_rope(q.view(-1, self.hq, self.dim), cos, sin)
        k = apply_rope(k.view(-1, self.hkv, self.dim), cos, sin)
        o = paged_attention(q, k, v.view(-1, self.hkv, self.dim), kv_layer, meta)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, h, cos, sin, kv_layer, meta) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_layer, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Decoder stack + LM head. `forward` returns hidden states; `compute_logits` the float32 logits."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", c.inv_freq(), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, positions, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i], meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()


# HF tensor name suffix -> (our parameter suffix, index of the slice in the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^layers\.(?P<layer>\d+)\.(?P<module>.+)\.(?P<kind>weight|bias)$")


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """Build the model on `device` in `dtype` and fill it from `path/*.safetensors`."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = config.inv_freq().to(device)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                _load_tensor(name, f.get_tensor(name), params, filled, config)
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
    if missing:
        raise ModelError(f"{path}: weights missing or incomplete for {missing[:3]} ({len(missing)} in all)")
    return model.eval()


def _load_tensor(name: str, t: torch.Tensor, params: dict, filled: dict, c: ModelConfig) -> None:
    name = name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and c.tie_word_embeddings):
        return
    key, offset = name, 0
    m = _LAYER_NAME.match(name)
    if m and m["module"] in _FUSED:
        target, idx = _FUSED[m["module"]]
        key = f"layers.{m['layer']}.{target}.{m['kind']}"
        offset = _fused_offset(target, idx, c)
    if key not in params:
        raise ModelError(f"unexpected weight {name!r} for a Llama model")
    p = params[key]
    if tuple(t.shape[1:]) != tuple(p.shape[1:]) or offset + t.shape[0] > p.shape[0]:
        raise ModelError(f"weight {name!r} has shape {tuple(t.shape)}, expected rows of {tuple(p.shape[1:])}")
    with torch.no_grad():
        p[offset : offset + t.shape[0]].copy_(t)
    filled[key] = filled.get(key, 0) + t.shape[0]


def _fused_offset(target: str, idx: int, c: ModelConfig) -> int:
    if target.endswith("qkv_proj"):
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return (0, q, q + kv)[idx]
    return idx * c.intermediate_size
