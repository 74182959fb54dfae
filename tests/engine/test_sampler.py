"""The sampler's logit adjustments (min_tokens, logit_bias, penalties) against a plain Python reference."""
from __future__ import annotations

import pytest
import torch

from engine.sampler import adjusted, sample
from engine.sequence import SamplingParams, Sequence
from tiers.types import ConfigError

VOCAB = 50
EOS = frozenset({2})


def request(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence(1, list(prompt), SamplingParams(**params))
    seq.token_ids += output
    return seq


def reference(logits: list[float], seq: Sequence) -> list[float]:
    """vLLM's order, one token at a time."""
    p, out, row = seq.params, seq.output_token_ids, list(logits)
    if len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | set(EOS):  # EOS even under ignore_eos, as in vLLM
            row[t] = float("-inf")
    for t, b in p.logit_bias.items():
        row[t] += b
    for t in set(seq.token_ids):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


@pytest.mark.parametrize("params", [
    {"min_tokens": 4, "stop_token_ids": (7, 9)},
    {"min_tokens": 4, "ignore_eos": True},
    {"logit_bias": {3: 100.0, 4: -100.0, 5: 0.5}},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"repetition_penalty": 2.5},
    {"frequency_penalty": 0.8, "presence_penalty": -0.5},
    {"min_tokens": 2, "logit_bias": {2: 5.0}, "repetition_penalty": 1.2, "frequency_penalty": 2.0, "presence_penalty": 2.0},
])
def test_adjusted_logits_match_the_reference(params):
    # A request with a prompt and an output that repeat tokens, and random logits (both signs).
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(VOCAB, generator=gen) * 3
    seq = request([1, 5, 5, 8, 3], [5, 9, 9, 9], **params)
    # Each adjustment agrees with the plain loop; the model's row itself is untouched.
    before = logits.clone()
    assert adjusted(logits, seq, EOS).tolist() == pytest.approx(reference(logits.tolist(), seq))
    assert torch.equal(logits, before)


def test_min_tokens_masks_end_tokens_until_reached_and_not_after():
    # EOS is the model's favourite at every step, then stop token 7, then token 5.
    logits = torch.zeros(1, VOCAB)
    logits[0, 2], logits[0, 7], logits[0, 5] = 10.0, 9.0, 8.0
    # Before min_tokens: neither EOS nor the stop token is picked, greedy or sampled.
    early = request([1], [4], min_tokens=3, stop_token_ids=(7,))
    assert sample(logits, [early], torch.Generator(), EOS) == [5]
    hot = request([1], [4], min_tokens=3, stop_token_ids=(7,), temperature=1.0, seed=3)
    assert all(sample(logits, [hot], torch.Generator().manual_seed(s), EOS)[0] not in (2, 7) for s in range(20))
    # Once the output holds min_tokens tokens, EOS is the greedy pick again.
    done = request([1], [4, 4, 4], min_tokens=3, stop_token_ids=(7,))
    assert sample(logits, [done], torch.Generator(), EOS) == [2]


def test_greedy_rows_without_adjustments_keep_the_plain_argmax_beside_adjusted_ones():
    # Two requests in one batch: one plain, one whose bias moves its pick.
    logits = torch.zeros(2, VOCAB)
    logits[:, 6] = 1.0
    plain, biased = request([1], []), request([1], [], logit_bias={11: 2.0})
    assert sample(logits, [plain, biased], torch.Generator(), EOS) == [6, 11]


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                                 {"repetition_penalty": float("inf")}, {"logit_bias": {1: 101.0}},
                                 {"logit_bias": {-1: 1.0}}, {"stop_token_ids": (-1,)},
                                 {"min_tokens": 9, "max_tokens": 8}, {"min_tokens": -1}])
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)
