"""Model identity for block keys, shared by every engine we connect.

Two engines (ours, vLLM) loading the same checkpoint must put the same
`model_id` into the namespace, or they could never share cached KV; two
different checkpoints must never share it. So the id is derived from the
files, not from a name: the directory name for humans, plus xxh3_64 over
config.json and every *.safetensors file, in name order.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import xxhash


@lru_cache(maxsize=32)
def _digest(path: str, stamp: tuple) -> str:
    h = xxhash.xxh3_64()
    for f in [Path(path) / "config.json", *sorted(Path(path).glob("*.safetensors"))]:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def model_id_for_dir(path: str | os.PathLike) -> str:
    """``<dir name>@<xxh3_64 hex of config.json + weights>`` for a HF model directory."""
    p = Path(path).resolve()
    files = [p / "config.json", *sorted(p.glob("*.safetensors"))]
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return f"{p.name}@{_digest(str(p), stamp)}"
