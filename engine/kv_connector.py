"""The hook through which the engine loads and offloads KV blocks.

The engine calls a connector at two points:

* admission: after its own prefix-cache match, it asks `num_cached_tokens`;
  when the connector holds a longer prefix, the engine allocates pages and
  calls `load`, then computes only from the returned position on;
* progress: after each prefill chunk, and once more when a request finishes,
  it calls `save` with the tokens that now have KV in the cache.

`kv_cache` is the engine's single tensor
``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (index 0 of
dim 1 is K, 1 is V); ``page_ids`` index its dim 2. Token ``t`` of a sequence
lives in page ``page_ids[t // page_size]`` at row ``t % page_size`` (for
`load`, relative to `start`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVConnector(Protocol):
    """An external KV store seen from the engine (implemented in `connectors/`)."""

    block_tokens: int
    """Tokens per stored block; a multiple of the engine's page_size."""

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """Length of the longest loadable prefix of `token_ids`, a multiple of
        `block_tokens`. No side effects; may be called more than once."""
        ...

    def load(self, token_ids: list[int], start: int, end: int, page_ids: list[int], kv_cache: torch.Tensor) -> int:
        """Write the KV of tokens [start, end) (block-aligned) into `page_ids`
        (which cover exactly those tokens, in order). Returns the end of the
        prefix actually loaded, block-aligned, ``start <= ret <= end``; the
        engine recomputes from there."""
        ...

    def save(self, token_ids: list[int], num_tokens: int, page_ids: list[int], kv_cache: torch.Tensor) -> None:
        """Tokens [0, num_tokens) of this sequence have KV in `page_ids` (its
        page table). Store the full blocks not stored yet; the pages may be
        reused once this returns, and it must not wait on slow storage."""
        ...
