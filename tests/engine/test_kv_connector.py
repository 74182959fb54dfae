"""The engine side of the KV connector protocol, driven by an in-test dict store.

`DictConnector` is scaffolding for the protocol only (the real connector lives
in connectors/): it keeps full blocks in a dict keyed by chained block hashes.
"""
from __future__ import annotations

import torch

from cache_service.blocks.keys import chain_hashes
from engine import SamplingParams
from engine.kv_connector import KVConnector

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


class DictConnector:
    def __init__(self, block_tokens: int, page_size: int, max_load_blocks: int | None = None):
        self.block_tokens, self.page_size = block_tokens, page_size
        self.max_load_blocks = max_load_blocks  # simulate a store that returns less than it promised
        self.blocks: dict[bytes, torch.Tensor] = {}  # hash -> [layers, 2, block_tokens, kv_heads, head_dim]
        self.loads: list[tuple[int, int, list[int]]] = []
        self.saves: list[int] = []

    def _hashes(self, token_ids: list[int], num_tokens: int) -> list[bytes]:
        return chain_hashes(bytes(16), token_ids[:num_tokens], self.block_tokens)

    def _pages(self, page_ids: list[int], block: int) -> list[int]:
        per = self.block_tokens // self.page_size
        return page_ids[block * per : (block + 1) * per]

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        n = 0
        for h in self._hashes(token_ids, len(token_ids)):
            if h not in self.blocks:
                break
            n += self.block_tokens
        return n

    def load(self, token_ids, start, end, page_ids, kv_cache) -> int:
        self.loads.append((start, end, list(page_ids)))
        hashes = self._hashes(token_ids, end)
        first = start // self.block_tokens
        last = len(hashes) if self.max_load_blocks is None else min(len(hashes), first + self.max_load_blocks)
        for b in range(first, last):
            pages = self._pages(page_ids, b - first)
            kv_cache[:, :, pages] = self.blocks[hashes[b]].unflatten(2, (len(pages), self.page_size))
        return last * self.block_tokens

    def save(self, token_ids, num_tokens, page_ids, kv_cache) -> None:
        self.saves.append(num_tokens)
        for b, h in enumerate(self._hashes(token_ids, num_tokens)):
            if h not in self.blocks:
                self.blocks[h] = kv_cache[:, :, self._pages(page_ids, b)].flatten(2, 3).clone()


def engine_pages(llm, tokens: list[int]) -> torch.Tensor:
    """KV of the full pages of `tokens` still held by `llm`'s prefix cache, as [L, 2, T, H, D]."""
    hashes = chain_hashes(llm.fingerprint, tokens, llm.page_size)
    pages = [llm.blocks.hash_to_page[h] for h in hashes]
    return llm.kv_cache[:, :, pages].flatten(2, 3)


def test_second_engine_loads_kv_saved_by_the_first(tiny_llm_factory, tiny_prompts):
    prompt = tiny_prompts[3]
    store = DictConnector(block_tokens=32, page_size=16)
    assert isinstance(store, KVConnector)
    # engine A computes the prompt cold and saves it through the connector
    a = tiny_llm_factory(kv_connector=store)
    out_a = a.generate([prompt], GREEDY)[0]
    assert out_a.num_cached_tokens == 0 and store.blocks
    # its final save covers every token with KV: prompt + generated - 1
    assert store.saves[-1] == len(prompt) + len(out_a.token_ids) - 1
    # a fresh engine B loads the prompt's blocks instead of computing them
    b = tiny_llm_factory(kv_connector=DictConnector(32, 16))
    b.kv_connector.blocks = store.blocks
    out_b = b.generate([prompt], GREEDY)[0]
    loadable = (len(prompt) - 1) // 32 * 32
    assert out_b.num_cached_tokens == loadable > 0 and out_b.num_local_cached_tokens == 0
    assert out_b.token_ids == out_a.token_ids
    # the pages B loaded hold exactly the KV a plain engine computes for those tokens
    plain = tiny_llm_factory()
    plain.generate([prompt], GREEDY)
    start, end, page_ids = b.kv_connector.loads[0]
    assert (start, end) == (0, loadable)
    loaded = b.kv_cache[:, :, page_ids].flatten(2, 3)
    assert torch.equal(loaded, engine_pages(plain, prompt[:loadable]))


def test_short_load_is_recomputed(tiny_llm_factory, tiny_prompts):
    prompt = tiny_prompts[3]
    store = DictConnector(block_tokens=16, page_size=16)
    cold = tiny_llm_factory(kv_connector=store).generate([prompt], GREEDY)[0]
    # the store delivers only its first block although it promised more
    short = DictConnector(16, 16, max_load_blocks=1)
    short.blocks = store.blocks
    out = tiny_llm_factory(kv_connector=short).generate([prompt], GREEDY)[0]
    start, end, _ = short.loads[0]
    assert end > 16 and out.num_cached_tokens == 16
    # the engine recomputed the rest and produced the same tokens
    assert out.token_ids == cold.token_ids


def test_local_hit_is_aligned_to_connector_blocks(tiny_llm_factory, tiny_prompts):
    prompt = tiny_prompts[3] + tiny_prompts[1]  # 93 tokens
    store = DictConnector(block_tokens=32, page_size=16)
    llm = tiny_llm_factory(kv_connector=store)
    # the engine's own cache holds the first 3 pages (48 tokens) of the prompt
    llm.generate([prompt[:49]], GREEDY)
    # the connector holds more of the prompt, so the local hit is cut back to a block boundary
    full = DictConnector(32, 16)
    tiny_llm_factory(kv_connector=full).generate([prompt], GREEDY)
    store.blocks.update(full.blocks)
    store.loads.clear()
    out = llm.generate([prompt], GREEDY)[0]
    loadable = (len(prompt) - 1) // 32 * 32
    assert out.num_local_cached_tokens == 32
    assert out.num_cached_tokens == loadable - 32
    assert store.loads[0][:2] == (32, loadable)
    assert out.token_ids == full_output(tiny_llm_factory, prompt)


def full_output(factory, prompt):
    return factory(enable_prefix_caching=False).generate([prompt], GREEDY)[0].token_ids


def test_chunked_prefill_saves_after_every_chunk(tiny_llm_factory, tiny_prompts):
    prompt = tiny_prompts[3]
    store = DictConnector(block_tokens=16, page_size=16)
    llm = tiny_llm_factory(kv_connector=store, max_num_batched_tokens=32)
    out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    # one save per 32-token chunk, then one at the end with everything that has KV
    chunks = list(range(32, len(prompt), 32)) + [len(prompt)]
    assert store.saves == chunks + [len(prompt) + 2]
    assert len(store.blocks) == (len(prompt) + 2) // 16
    assert out.token_ids == full_output(tiny_llm_factory, prompt)[:3]
