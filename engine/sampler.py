"""Token sampling: greedy, or temperature + top-k + top-p with a seedable generator."""
from __future__ import annotations

import torch

from engine.sequence import Sequence

GREEDY_BELOW = 1e-5  # a temperature this small is greedy: dividing by it overflows float32 logits


def sample(logits: torch.Tensor, seqs: list[Sequence], default_gen: torch.Generator) -> list[int]:
    """Pick one token per row of `logits` ([B, vocab], float32) for `seqs` (same order)."""
    assert logits.shape[0] == len(seqs)
    out = logits.argmax(-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.temperature >= GREEDY_BELOW:
            gen = seq.generator if seq.generator is not None else default_gen
            out[i] = _sample_row(_top_k(logits[i], p.top_k), p.temperature, p.top_p, gen)
    return out


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Only the k most likely tokens stay candidates (k <= 0: all)."""
    if k <= 0 or k >= logits.numel():
        return logits
    kth = logits.topk(k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _sample_row(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        pick = torch.multinomial(sorted_p, 1, generator=gen)
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=gen))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request generator when a seed is given (reproducible regardless of batching)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
