"""Model identity and the KV namespace, shared by every engine we connect.

Two engines (ours, vLLM) loading the same checkpoint must put the same
`model_id` into the namespace, or they could never share cached KV; two
different checkpoints must never share it. So the id is derived from the
files, not from a name: the directory name for humans, plus xxh3_64 over
config.json and every weights file (safetensors, PyTorch .bin/.pt/.pth,
GGUF), in name order. `kv_namespace`
builds the namespace an engine's blocks are keyed under from that id and the
KV layout (engine/llm.py and connectors/vllm/connector.py both call it).
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import xxhash

from cache_service.blocks.keys import Namespace
from tiers.types import ConfigError

_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


@lru_cache(maxsize=32)
def _digest(path: str, stamp: tuple) -> str:
    h = xxhash.xxh3_64()
    for f in _files(Path(path)):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def model_id_for_dir(path: str | os.PathLike) -> str:
    """``<dir name>@<xxh3_64 hex of config.json + weights>`` for a HF model directory."""
    p = Path(path).resolve()
    files = _files(p)
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return f"{p.name}@{_digest(str(p), stamp)}"


def _files(p: Path) -> list[Path]:
    """config.json and the weights files of a checkpoint directory, in name order."""
    weights = sorted({f for pattern in _WEIGHTS for f in p.glob(pattern)})
    if not weights:
        raise ConfigError(f"{p}: no weights files ({', '.join(_WEIGHTS)}): cannot tell this checkpoint's KV apart")
    return [p / "config.json", *weights]


def kv_namespace(model: str | os.PathLike, kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 block_tokens: int, tenant: str = "", revision: str = "", tp_rank: int = 0,
                 tp_world: int = 1) -> Namespace:
    """The namespace of a model's KV: `model` a local checkpoint directory
    (identified by its files, `model_id_for_dir`) or a hub name (identified
    by name and `revision`)."""
    if Path(model).is_dir():
        model_id, revision = model_id_for_dir(model), ""
    else:
        model_id = str(model)
    return Namespace(model_id, kv_dtype, num_layers, num_kv_heads, head_dim, block_tokens=block_tokens,
                     model_revision=revision, tp_rank=tp_rank, tp_world=tp_world, tenant_salt=tenant)
