"""End-to-end behaviour of the engine on the tiny random Llama (float32)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, PromptError, SamplingParams
from engine.errors import ModelError
from tiers.types import ConfigError, TierKVError

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_greedy_matches_transformers(tiny_llm_factory, tiny_prompts, tiny_path, hf_greedy):
    # our engine and transformers' generate run the same fp32 weights
    llm = tiny_llm_factory(enable_prefix_caching=False)
    outs = llm.generate(tiny_prompts, GREEDY)
    # every prompt's greedy continuation is the same token for token
    for prompt, out in zip(tiny_prompts, outs):
        assert out.token_ids == hf_greedy(tiny_path, prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length" and out.num_cached_tokens == 0
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)


def test_prefix_cache_hit_matches_cold_run(tiny_llm_factory, tiny_prompts):
    # a cold engine without prefix caching is the control
    cold = tiny_llm_factory(enable_prefix_caching=False).generate(tiny_prompts[1:2], GREEDY)[0]
    llm = tiny_llm_factory()
    first = llm.generate(tiny_prompts[1:2], GREEDY)[0]
    # the same prompt again hits every full page but the one holding the last token
    second = llm.generate(tiny_prompts[1:2], GREEDY)[0]
    n = len(tiny_prompts[1])
    assert first.num_local_cached_tokens == 0
    assert second.num_local_cached_tokens == (n - 1) // llm.page_size * llm.page_size > 0
    assert first.token_ids == second.token_ids == cold.token_ids


def test_shared_prefix_partial_hit(tiny_llm_factory, tiny_prompts):
    # two prompts share a 40-token prefix and then differ
    base = tiny_prompts[3][:40]
    a, b = base + tiny_prompts[0][-8:], base + tiny_prompts[2][-5:]
    llm = tiny_llm_factory()
    llm.generate([a], GREEDY)
    out_b = llm.generate([b], GREEDY)[0]
    # b reuses the two full pages of the shared prefix and still matches a cold run
    assert out_b.num_local_cached_tokens == 32
    assert out_b.token_ids == tiny_llm_factory(enable_prefix_caching=False).generate([b], GREEDY)[0].token_ids


def test_chunked_prefill_matches_unchunked(tiny_llm_factory, tiny_prompts):
    # 16 tokens per step forces every prompt through several prefill chunks
    whole = tiny_llm_factory(enable_prefix_caching=False).generate(tiny_prompts, GREEDY)
    chunked = tiny_llm_factory(enable_prefix_caching=False, max_num_batched_tokens=16).generate(tiny_prompts, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_batch_matches_each_prompt_alone(tiny_llm_factory, tiny_prompts):
    # prompts of different lengths decode together in one forward per step
    batched = tiny_llm_factory().generate(tiny_prompts, GREEDY)
    for prompt, out in zip(tiny_prompts, batched):
        alone = tiny_llm_factory(enable_prefix_caching=False).generate([prompt], GREEDY)[0]
        assert out.token_ids == alone.token_ids


def test_preemption_recomputes_and_matches(tiny_llm_factory, tiny_prompts):
    # a cache too small for all four sequences at once forces preemption by recompute
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    small = tiny_llm_factory(num_pages=10, max_model_len=160)
    outs = small.generate(tiny_prompts, params)
    assert small.scheduler.num_preemptions > 0
    # every output is what the prompt gives alone in a roomy engine
    roomy = tiny_llm_factory(enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(tiny_prompts, params)]
    # and every page went back to the free lists
    assert small.blocks.num_free_pages == small.blocks.num_pages
    # distinct prompts computed cold report nothing cached, though a preempted one matched its own pages again
    assert [(o.num_cached_tokens, o.num_local_cached_tokens) for o in outs] == [(0, 0)] * len(outs)


def test_seeded_sampling_is_reproducible(tiny_llm_factory, tiny_prompts):
    llm = tiny_llm_factory()
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, seed=s, ignore_eos=True) for s in (7, 7, 8)]
    # the same seed gives the same tokens, in one batch and across calls
    a, b, c = llm.generate(tiny_prompts[:1] * 3, params)
    again = llm.generate(tiny_prompts[:1], params[0])[0]
    assert a.token_ids == b.token_ids == again.token_ids
    # another seed gives another sample, and sampling is not greedy decoding
    assert c.token_ids != a.token_ids
    assert a.token_ids != llm.generate(tiny_prompts[:1], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids


def test_tiny_top_p_is_greedy(tiny_llm_factory, tiny_prompts):
    # top_p so small that only the most likely token survives equals greedy decoding
    llm = tiny_llm_factory()
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=16, seed=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    assert llm.generate(tiny_prompts[:1], nucleus)[0].token_ids == llm.generate(tiny_prompts[:1], greedy)[0].token_ids


def test_stop_tokens_and_eos(tiny_llm_factory, tiny_prompts):
    llm = tiny_llm_factory()
    free = llm.generate(tiny_prompts[:1], GREEDY)[0].token_ids
    # a stop token ends the output right after it appears (and is kept)
    stop = free[5]
    out = llm.generate(tiny_prompts[:1], SamplingParams(max_tokens=24, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert out.token_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"
    # EOS stops generation unless ignored
    eos = llm.tokenizer.eos_token_id
    forced = llm.generate([tiny_prompts[0] + [eos]], SamplingParams(max_tokens=24))[0]
    assert eos not in forced.token_ids[:-1]
    assert forced.finish_reason == ("stop" if eos in forced.token_ids else "length")


def test_generation_stops_at_max_model_len(tiny_llm_factory, tiny_prompts):
    llm = tiny_llm_factory(max_model_len=len(tiny_prompts[0]) + 5)
    out = llm.generate(tiny_prompts[:1], GREEDY)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_bad_inputs(tiny_llm_factory, tiny_prompts):
    llm = tiny_llm_factory(max_model_len=32)
    # a prompt longer than max_model_len is refused with a clear message
    with pytest.raises(PromptError, match="max_model_len 32"):
        llm.generate([[5, 6, 7], list(range(33))], GREEDY)
    # and nothing of that call stays queued
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert issubclass(PromptError, ValueError) and issubclass(PromptError, TierKVError)
    # so are an empty prompt and token ids outside the vocabulary
    with pytest.raises(PromptError):
        llm.generate([[]], GREEDY)
    with pytest.raises(PromptError):
        llm.generate([[1, 2, llm.model_config.vocab_size]], GREEDY)
    # as are a logit bias or stop token outside it: refused before queueing, and the engine goes on
    vocab = llm.model_config.vocab_size
    for params in (SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}),
                   SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=(vocab,))):
        with pytest.raises(PromptError, match="token ids"):
            llm.generate([[5, 6, 7]], params)
        assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 100.0}))[0].token_ids == \
        [vocab - 1] * 2
    # and bad sampling or engine settings
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError):
        tiny_llm_factory(dtype="int4")
    # an unknown model name is a ModelError
    with pytest.raises(ModelError, match="unknown model"):
        LLM("no-such-model")


def test_string_prompts_and_timings(tiny_llm_factory):
    llm = tiny_llm_factory()
    out = llm.generate("What is the capital of France?", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("What is the capital of France?")
    assert len(out.token_ids) == 4
    assert 0 < out.ttft_s <= out.total_s


def test_kv_cache_layout_contract(tiny_llm_factory):
    llm = tiny_llm_factory(page_size=8, num_pages=32)
    c = llm.model_config
    assert llm.kv_cache.shape == (c.num_layers, 2, 32, 8, c.num_kv_heads, c.head_dim)
    assert llm.kv_cache.dtype == torch.float32 and llm.kv_cache.is_contiguous()


def test_bfloat16_kv_is_close_to_float32(tiny_llm_factory, tiny_prompts):
    from cache_service.blocks.keys import chain_hashes

    # the same prompt through a bf16 engine and an fp32 engine
    prompt = tiny_prompts[3]
    kv = {}
    for dtype in ("bfloat16", "float32"):
        llm = tiny_llm_factory(dtype=dtype)
        out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
        pages = [llm.blocks.hash_to_page[h] for h in chain_hashes(llm.fingerprint, prompt, llm.page_size)]
        assert llm.kv_cache.dtype == getattr(torch, dtype)
        kv[dtype] = llm.kv_cache[:, :, pages].float()
    # the cached K/V agree to bf16 precision
    assert kv["bfloat16"].abs().max() > 0
    torch.testing.assert_close(kv["bfloat16"], kv["float32"], rtol=0.05, atol=0.05)


def test_connector_block_size_must_fit_pages(tiny_llm_factory):
    class Odd:
        block_tokens = 24

    llm = tiny_llm_factory()
    with pytest.raises(ConfigError, match="block_tokens 24"):
        llm.set_kv_connector(Odd())


class _FailingLoads:
    """A KV connector whose loads fail inside the engine (a device error scattering the blocks, say)."""

    block_tokens = 16

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        return (len(token_ids) - 1) // 16 * 16

    def load(self, *args) -> int:
        raise RuntimeError("a device error while scattering loaded blocks")

    def save(self, *args) -> None:
        pass


def test_a_request_whose_admission_fails_gives_back_its_pages(tiny_llm_factory):
    llm = tiny_llm_factory(num_pages=16)
    llm.set_kv_connector(_FailingLoads())
    seq = llm.add_request(list(range(5, 60)), SamplingParams(max_tokens=4))
    # The step fails while admitting it; the server then aborts it (EngineLoop._fail_all).
    with pytest.raises(RuntimeError, match="device error"):
        llm.step()
    llm.abort(seq)
    # Every page is free again.
    assert seq.is_finished and llm.blocks.num_free_pages == llm.blocks.num_pages


def test_cached_tokens_count_prompt_tokens_only_after_a_preemption(tiny_llm_factory):
    llm = tiny_llm_factory(num_pages=8, page_size=16, max_num_batched_tokens=256)
    prompts = [[5 + (i * 7 + j) % 100 for j in range(20)] for i in range(2)]
    # Two long generations in eight pages: one is preempted and matched again over prompt and output.
    outs = llm.generate(prompts, SamplingParams(max_tokens=70, ignore_eos=True))
    assert llm.scheduler.num_preemptions >= 1
    for out in outs:
        assert out.num_cached_tokens + out.num_local_cached_tokens <= len(out.prompt_token_ids)
