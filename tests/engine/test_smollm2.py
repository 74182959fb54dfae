"""SmolLM2-135M-Instruct: the real model, converted once from its PyPI GGUF package."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How do I boil an egg?"]


@pytest.fixture(scope="module")
def smollm2_fp32():
    return LLM("smollm2", dtype="float32", num_pages=64)


def test_greedy_matches_transformers(smollm2_fp32, hf_greedy):
    llm = smollm2_fp32
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    # the three chats decode in one batch, token for token like transformers' generate
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(llm.path, prompt, 24)


def test_answers_the_sanity_question(smollm2_fp32):
    llm = smollm2_fp32
    prompt = llm.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    out = llm.generate([prompt], SamplingParams(max_tokens=32))[0]
    # stops at <|im_end|> after the known answer
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.tokenizer.eos_token_id
    # the model facts the connector's namespace relies on
    c = llm.model_config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (30, 3, 64, True)
