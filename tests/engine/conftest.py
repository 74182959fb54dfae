"""Shared fixtures: the tiny-random model, its transformers twin, and prompts."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.models import resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Tell me a short story about a robot who learns to paint, with a happy ending.",
    "hi",
    "List the numbers 1 2 3 4 5 6 7 8 9 10 and then explain what a key-value cache keeps for each token.",
]


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Run the engine tests on one intra-op thread.

    Results do not depend on it, but on a shared 2-core runner an OpenMP team of
    two spin-waits behind other processes and the suite runs ~4x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_path():
    return resolve_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_llm_factory(tiny_path):
    """Build tiny-random engines in float32 with a small cache unless told otherwise."""

    def make(**kw) -> LLM:
        kw.setdefault("dtype", "float32")
        kw.setdefault("num_pages", 256)
        return LLM("tiny-random", **kw)

    return make


@pytest.fixture(scope="session")
def tiny_prompts(tiny_llm_factory):
    llm = tiny_llm_factory(num_pages=8)
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="session")
def hf_greedy():
    """Greedy continuation by transformers' `generate` on a model directory (EOS disabled)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def run(path, prompt: list[int], max_new_tokens: int) -> list[int]:
        if path not in cache:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # compare full-length continuations
            cache[path] = model
        out = cache[path].generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return run
