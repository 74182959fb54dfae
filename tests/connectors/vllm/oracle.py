"""Independent readers of vLLM's KV cache layouts (the tests' oracles), and
small helpers shared by the vLLM tests.

Plain per-token indexing, written from vLLM's attention sources, not from
our adapters:

- CPU attention: a layer ``(pages, H, page, 2 * D)``; each (page, head) is a
  region of ``2 * page * D`` elements, K half first. vLLM's "vec" family of
  ISAs (vec, vec16, NEON, VSX, ...) writes K column-major (``[D, page]``) and
  V row-major (``[page, D]``); "amx" packs K in groups of 16 tokens with
  head dims in 32-bit pairs and V in groups of 16 head dims with tokens in
  pairs (see `cpu_index`); `cpu_index` also makes token-major and arbitrary
  permuted packings for the unit tests;
- flash-attention: a layer ``[2, pages, page, H, D]``: ``[0]`` K, ``[1]`` V.
"""
from __future__ import annotations

import random

import torch

K_TRANSPOSED_ISAS = ("vec", "vec16", "neon", "vsx", "vxe", "rvv")


def cpu_index(kind: str, page: int, dim: int, seed: int = 0) -> torch.Tensor:
    """``[2, page, D]``: flat position of (kv, token, dim) in one region, for a packing `kind`."""
    t = torch.arange(page).view(page, 1)
    d = torch.arange(dim).view(1, dim)
    if kind == "tokens":
        k, v = t * dim + d, page * dim + t * dim + d
    elif kind == "k_transposed":
        k, v = d * page + t, page * dim + t * dim + d
    elif kind == "amx":
        # vLLM's csrc/cpu/cpu_attn_amx.hpp, AttentionImpl<ISA::AMX>::reshape_and_cache (bf16, page % 32 == 0).
        # K: tokens in groups of 16 (64-byte tile rows / 4); in a group, 32-bit word j * 16 + r holds head
        # dims (2j, 2j + 1) of token r. V: head dims in groups of 16 (amx_b_tile_n_size), each group a
        # [page / 2, 16, 2] tile (token pair, dim, token parity), after the K half.
        assert page % 16 == 0 and dim % 16 == 0, (page, dim)
        k = (t // 16) * 16 * dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
        v = page * dim + (d // 16) * 16 * page + (t // 2) * 32 + (d % 16) * 2 + t % 2
    elif kind == "permuted":
        perm = torch.randperm(2 * page * dim, generator=torch.Generator().manual_seed(seed))
        return perm.view(2, page, dim)
    else:
        raise ValueError(kind)
    return torch.stack([k, v])


def read_tokens(layers: list[torch.Tensor], page_ids: list[int], first_token: int, start: int, end: int,
                index: torch.Tensor | None = None) -> torch.Tensor:
    """K/V of tokens [start, end) as ``[L, 2, T, H, D]``; ``page_ids[0]`` holds token `first_token`.
    CPU layers need the packing `index` (`cpu_index`)."""
    out = []
    for layer in layers:
        page = layer.shape[2]  # both layouts keep a page's tokens in dim 2
        k, v = [], []
        for t in range(start, end):
            p, r = page_ids[(t - first_token) // page], t % page
            if layer.dim() == 5:
                k.append(layer[0, p, r])
                v.append(layer[1, p, r])
            else:
                region = layer.view(layer.shape[0], layer.shape[1], -1)[p]  # [H, 2 * page * D]
                k.append(region[:, index[0, r]])
                v.append(region[:, index[1, r]])
        out.append(torch.stack([torch.stack(k), torch.stack(v)]))
    return torch.stack(out).clone()


def blocks_as_tokens(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Store payloads ``[L, 2, bt, H, D]`` in order -> ``[L, 2, T, H, D]``."""
    return torch.cat(list(blocks), dim=2)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (compared as integers of the element size)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(as_int),
                                                                     b.contiguous().view(as_int))


def tokens(n: int, seed: int) -> list[int]:
    """n deterministic token ids that avoid the special ids 0-2."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]
