"""The blocked CPU prefill attention against SDPA with an explicit causal mask."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import causal_attention_cpu


def reference(q, k, v):
    ctx, n = k.shape[0], q.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("ctx, n", [(1, 1), (37, 37), (300, 300), (300, 41), (300, 1)])
@pytest.mark.parametrize("score_bytes", [1, 1 << 24])  # many 16-query blocks, or one block
def test_matches_masked_sdpa(ctx, n, score_bytes):
    g = torch.Generator().manual_seed(ctx * 1000 + n)
    # 6 query heads share 2 KV heads; queries are the last n positions of the context
    q = torch.randn(n, 6, 32, generator=g)
    k, v = torch.randn(ctx, 2, 32, generator=g), torch.randn(ctx, 2, 32, generator=g)
    out = causal_attention_cpu(q, k, v, score_bytes=score_bytes)
    torch.testing.assert_close(out, reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_bfloat16_stays_close_to_float32():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(200, s, 64, generator=g) for s in (9, 3, 3))
    out = causal_attention_cpu(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q, k, v), rtol=0, atol=0.05)
