"""Model and engine configuration.

`ModelConfig` is read from a Hugging Face Llama `config.json`; `EngineConfig`
holds the knobs of the paged KV cache and the scheduler.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import ModelError
from tiers.types import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LLAMA_FAMILY = {"llama", "mistral", "qwen2"}
_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}  # CPUs that compute in bfloat16 natively


def auto_dtype(device: torch.device) -> str:
    """The compute dtype "auto" means: bfloat16 on CUDA and on CPUs with
    native bfloat16 (AVX512-BF16, AMX); float32 elsewhere, where bfloat16 is
    emulated (a 3.6k-token prefill of SmolLM2 took 223 s in bfloat16 and 15 s
    in float32 on an AVX2-only EPYC)."""
    if device.type != "cpu":
        return "bfloat16"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "bfloat16" if _BF16_CPU_FLAGS & set(flags) else "float32"


@dataclass(slots=True)
class ModelConfig:
    """The architecture facts the engine needs, from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_attention_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ModelError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        """Parse `path/config.json`; raises ModelError when it is not a Llama-family config."""
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read {path / 'config.json'}: {e}") from None
        if raw.get("model_type", "llama") not in _LLAMA_FAMILY:
            raise ModelError(f"model_type {raw.get('model_type')!r} in {path} is not a Llama-family model")
        # transformers >= 5 writes rope_parameters; older configs use rope_theta + rope_scaling
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        try:
            heads = raw["num_attention_heads"]
            return cls(
                vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
                num_heads=heads, num_kv_heads=raw.get("num_key_value_heads", heads),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                attention_bias=raw.get("attention_bias", False), eos_token_ids=eos,
            )
        except KeyError as e:
            raise ModelError(f"{path / 'config.json'} lacks {e.args[0]!r}") from None

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (float32), with linear / llama3 scaling applied."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if kind == "linear":
            return inv / self.rope_scaling["factor"]
        if kind == "llama3":
            return _llama3_scale(inv, self.rope_scaling)
        return inv


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(is_mid, mid, scaled)


@dataclass(slots=True)
class EngineConfig:
    """Paged KV cache and scheduler limits (validated here, used everywhere)."""

    page_size: int = 16
    num_pages: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    kv_cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"engine.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ConfigError(f"engine.num_pages must be an int >= 2, got {self.num_pages!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ConfigError(f"engine.max_model_len must be a positive int, got {self.max_model_len!r}")

    def resolve(self, model: ModelConfig, dtype: torch.dtype) -> None:
        """Fill num_pages (from the byte budget) and max_model_len (from the model and the cache)."""
        per_token = model.num_layers * 2 * model.num_kv_heads * model.head_dim * dtype.itemsize
        max_len = self.max_model_len or model.max_position_embeddings
        if self.num_pages is None:
            wanted = self.max_num_seqs * math.ceil(max_len / self.page_size)
            budget = self.kv_cache_bytes // (per_token * self.page_size)
            self.num_pages = max(2, min(wanted, budget))
        self.max_model_len = min(max_len, self.num_pages * self.page_size)
