"""Paged attention over the engine's KV cache (pure torch; CPU and CUDA).

A step's tokens are flattened into one batch. Single-token spans (decodes)
come first and are attended together with ``scaled_dot_product_attention``,
padded to the longest context; every multi-token span (a prefill chunk) is
attended on its own over its gathered context (blocked GEMMs on CPU, SDPA
elsewhere).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of queries, rows [start, end) of the flat batch."""

    start: int
    end: int
    ctx_slots: torch.Tensor | None  # [ctx_len] cache slots; None: the context is exactly this chunk
    mask: torch.Tensor | None  # [chunk, ctx_len] bool, True = attend (built off CPU only); None: causal


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step indices, built once by the model runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes (page * page_size + offset)
    num_decodes: int  # rows [0, num_decodes) are single-token spans
    decode_slots: torch.Tensor | None  # [B, max_ctx] context slots, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_ctx] bool, False on padding
    prefills: list[PrefillSpan]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Store this step's K/V into the pages, then attend.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_layer: [2, num_pages, page_size, Hkv, D].
    Returns [T, Hq, D].
    """
    hkv, dim = k.shape[1], k.shape[2]
    k_cache = kv_layer[0].view(-1, hkv, dim)
    v_cache = kv_layer[1].view(-1, hkv, dim)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.num_decodes:
        b = meta.num_decodes
        out[:b] = _decode(q[:b], k_cache, v_cache, meta.decode_slots, meta.decode_mask)
    for span in meta.prefills:
        out[span.start : span.end] = _prefill(q, k, v, k_cache, v_cache, span)
    return out


def _decode(q, k_cache, v_cache, slots, mask):
    b, hq, dim = q.shape
    hkv = k_cache.shape[1]
    # One query per sequence: fold the query heads of a KV group into the query-length axis,
    # so the grouped K/V are never repeated.
    qg = q.view(b, hkv, hq // hkv, dim)
    kc = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    vc = v_cache[slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask)
    return o.reshape(b, hq, dim)


def _prefill(q, k, v, k_cache, v_cache, span: PrefillSpan):
    if span.ctx_slots is None:
        ks, vs = k[span.start : span.end], v[span.start : span.end]
    else:
        ks, vs = k_cache[span.ctx_slots], v_cache[span.ctx_slots]
    qs = q[span.start : span.end]
    if qs.device.type == "cpu":
        return causal_attention_cpu(qs, ks, vs)
    o = F.scaled_dot_product_attention(
        qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
        attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_bytes: int = 1 << 24) -> torch.Tensor:
    """Causal GQA attention of the last n positions of a context, in query blocks.

    q: [n, Hq, D] for positions [L - n, L); k, v: [L, Hkv, D]. Returns [n, Hq, D].
    On CPU this runs about twice as fast as SDPA's flash kernel: each block is two
    batched GEMMs over only the keys it can see with a softmax between (scores in
    the model dtype, reduced in float32 inside the kernel: the numerics of the
    reference "eager" attention). Query heads sharing a KV head are stacked so K
    and V are never repeated.
    """
    n, hq, dim = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    g, offset = hq // hkv, ctx - n
    block = max(16, min(256, score_bytes // (4 * hq * ctx)))
    # rows ordered (position, head-in-group) per KV head, so a block of positions is a plain view
    qh = (q * dim**-0.5).view(n, hkv, g, dim).transpose(0, 1).contiguous()  # [Hkv, n, G, D]
    kt = k.permute(1, 2, 0)  # [Hkv, D, L]
    vh = v.transpose(0, 1)  # [Hkv, L, D]
    tri = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)[:, None, :]  # [i, 1, j]: j > i
    out = torch.empty_like(q)
    for a in range(0, n, block):
        b = min(a + block, n)
        nb, seen = b - a, offset + b  # keys visible to the last query of the block
        s = torch.bmm(qh[:, a:b].reshape(hkv, nb * g, dim), kt[:, :, :seen]).view(hkv, nb, g, seen)
        s[..., offset + a : seen].masked_fill_(tri[:nb, :, :nb], float("-inf"))
        p = torch.softmax(s, dim=-1).view(hkv, nb * g, seen)
        o = torch.bmm(p, vh[:, :seen]).view(hkv, nb, g, dim)
        out[a:b].view(nb, hkv, g, dim).copy_(o.transpose(0, 1))
    return out
