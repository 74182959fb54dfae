"""Token sampling: greedy, or temperature + top-k + top-p with a seedable generator.

Before either, a request's logits are adjusted as vLLM's logits processors
do, in their order: EOS and stop tokens masked until `min_tokens`, then
`logit_bias` added, then the repetition penalty (prompt and output tokens)
and the frequency and presence penalties (output tokens)."""
from __future__ import annotations

import torch

from engine.sequence import Sequence

GREEDY_BELOW = 1e-5  # a temperature this small is greedy: dividing by it overflows float32 logits


def sample(logits: torch.Tensor, seqs: list[Sequence], default_gen: torch.Generator,
           eos_ids: frozenset[int] = frozenset()) -> list[int]:
    """Pick one token per row of `logits` ([B, vocab], float32) for `seqs` (same order);
    `eos_ids`: the model's end tokens (masked until a request's min_tokens)."""
    assert logits.shape[0] == len(seqs)
    out = logits.argmax(-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.adjusts_logits and p.temperature < GREEDY_BELOW:
            continue  # the plain argmax: no row view (a batch of greedy rows pays nothing per row)
        row = adjusted(logits[i], seq, eos_ids) if p.adjusts_logits else logits[i]
        if p.temperature >= GREEDY_BELOW:
            gen = seq.generator if seq.generator is not None else default_gen
            out[i] = _sample_row(_top_k(row, p.top_k), p.temperature, p.top_p, gen)
        else:
            out[i] = int(row.argmax())
    return out


def adjusted(logits: torch.Tensor, seq: Sequence, eos_ids: frozenset[int]) -> torch.Tensor:
    """A copy of one request's logits with its min_tokens, logit_bias and penalties applied
    (EOS is masked under min_tokens even with ignore_eos, as in vLLM)."""
    p, out, dev = seq.params, seq.output_token_ids, logits.device
    logits = logits.clone()
    if len(out) < p.min_tokens:
        logits[sorted(set(p.stop_token_ids) | set(eos_ids))] = float("-inf")
    if p.logit_bias:
        logits[list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=dev)
    if p.repetition_penalty == 1.0 and not (p.frequency_penalty or p.presence_penalty):
        return logits
    counts = torch.bincount(torch.tensor(out, dtype=torch.long, device=dev), minlength=logits.numel())
    if p.repetition_penalty != 1.0:
        if seq.prompt_mask is None:  # once per request: a prompt of thousands of tokens, not per step
            prompt = torch.tensor(seq.token_ids[:seq.num_prompt_tokens], dtype=torch.long, device=dev)
            seq.prompt_mask = torch.bincount(prompt, minlength=logits.numel()) > 0
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seq.prompt_mask | (counts > 0), penalised, logits)
    if p.frequency_penalty or p.presence_penalty:
        counts = counts.to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


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
