"""The store namespace of a vLLM instance: everything that makes its KV
bytes differ from another's (checkpoint, KV layout, tensor-parallel rank,
pipeline stage, quantization, overrides), so two instances share blocks
exactly when their KV is the same (`connectors/model_id.py` for the
checkpoint's id, which our own engine derives alike)."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

import xxhash

from cache_service.blocks.keys import KV_DTYPES, Namespace
from connectors.model_id import kv_namespace
from connectors.vllm.scheduler import TierKVConfig
from tiers.types import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def build_namespace(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: TierKVConfig,
                    tp_rank: int) -> tuple[Namespace, int]:
    """The store namespace of this vLLM instance and vLLM's block size."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"TierKVConnector supports one KV cache group, vLLM has {len(groups)} "
                          f"(hybrid or sliding-window models are not supported)")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        # vLLM puts its null block in place of pages outside the window: a save would store it as real KV
        raise ConfigError(f"TierKVConnector does not support sliding-window or chunked local attention "
                          f"({type(spec).__name__})")
    head_dim, heads = getattr(spec, "head_size", None), getattr(spec, "num_kv_heads", None)
    if head_dim is None or heads is None or getattr(spec, "head_size_v", head_dim) != head_dim:
        raise ConfigError(f"TierKVConnector needs standard attention KV, got {type(spec).__name__}")
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        raise ConfigError(f"KV cache dtype {dtype} is not one tierkv stores ({', '.join(KV_DTYPES)})")
    mc = vllm_config.model_config
    page = spec.block_size
    if page % cfg.block_tokens and cfg.block_tokens % page:
        raise ConfigError(f"kv_connector_extra_config.block_tokens {cfg.block_tokens} must divide or be a "
                          f"multiple of vLLM's block_size {page}")
    ns = kv_namespace(str(mc.model), dtype, len(groups[0].layer_names), heads, head_dim,
                      block_tokens=cfg.block_tokens, tenant=cfg.tenant, revision=str(mc.revision or ""),
                      tp_rank=tp_rank, tp_world=vllm_config.parallel_config.tensor_parallel_size)
    return replace(ns, model_id=ns.model_id + _variant(vllm_config, groups[0].layer_names)), page


def _variant(vllm_config: "VllmConfig", layer_names: list[str]) -> str:
    """What besides the checkpoint and the KV layout changes this instance's
    KV bytes, appended to the model id: the layers of its pipeline stage,
    online quantization, config overrides (nothing in the common case, so
    the id stays the one our own engine derives)."""
    mc, parts = vllm_config.model_config, []
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) > 1:
        layers = [int(m.group(1)) for n in layer_names if (m := re.search(r"\.(\d+)\.", n))]
        parts.append(f"layers={min(layers)}-{max(layers)}" if layers else f"stage={','.join(layer_names)}")
    if getattr(mc, "quantization", None):
        parts.append(f"quant={mc.quantization}")
    overrides = getattr(mc, "hf_overrides", None)
    if overrides:
        text = getattr(overrides, "__qualname__", None) or repr(sorted(overrides.items()) if isinstance(overrides, dict)
                                                                 else overrides)
        parts.append(f"overrides={xxhash.xxh3_64_hexdigest(text)}")
    return "".join(f";{p}" for p in parts)
