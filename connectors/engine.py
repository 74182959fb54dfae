"""The KV connector of our own engine (implements engine.kv_connector.KVConnector).

Admission: hash the prompt's full blocks, ask the cache how long a prefix it
holds, and scatter the loaded blocks into the engine's pages. Progress: after
each prefill chunk and at the end of a request, gather the full blocks not
stored yet and hand them to the store, which copies them into its host tier
and persists lower tiers in the background.

A block that fails to load (miss, corruption) ends the loaded prefix; the
engine recomputes from there, so a bad cache never changes an answer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from cache_service.blocks.keys import Namespace
from connectors.client import CacheClient
from connectors.prefix import StoredBlocks, block_hashes, full_blocks, loaded_prefix
from kernels import gather_blocks, scatter_blocks
from tiers.types import ConfigError

log = logging.getLogger("tierkv.connector")


@dataclass(slots=True)
class ConnectorStats:
    """What this connector did, for the CLI summary and tests."""

    lookups: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0
    blocks_saved: int = 0
    errors: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)


class EngineConnector:
    """Connects the engine's paged KV cache to a CacheClient for one namespace."""

    def __init__(self, client: CacheClient, ns: Namespace, page_size: int, remember: int = 1 << 16) -> None:
        if ns.block_tokens % page_size:
            raise ConfigError(f"block_tokens {ns.block_tokens} must be a multiple of the engine's page size {page_size}")
        self.client, self.ns, self.page_size = client, ns, page_size
        self.block_tokens = ns.block_tokens
        self._pages_per_block = ns.block_tokens // page_size
        self._known = StoredBlocks(remember)
        self.stats = ConnectorStats()

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        self.stats.lookups += 1
        hashes = full_blocks(self.ns, token_ids)
        errors = self._client_errors()
        try:
            held = self.client.lookup(hashes)
        except Exception:  # dispatch boundary: an unusable cache is a miss
            log.exception("lookup failed; treating as a miss")
            self.stats.errors += 1
            return 0
        if self._client_errors() == errors:  # an answer, not a failure the client turned into a miss
            self._known.forget(hashes[held:])  # evicted or lost since they were stored: saved again once computed
        return held * self.block_tokens

    def _client_errors(self) -> int:
        """The failures the client counted (a daemon's client answers a failed call as a miss)."""
        return getattr(self.client, "errors", 0)

    def load(self, token_ids: list[int], start: int, end: int, page_ids: list[int], kv_cache: torch.Tensor) -> int:
        bt = self.block_tokens
        assert start % bt == 0 and end % bt == 0 and len(page_ids) * self.page_size >= end - start
        hashes = block_hashes(self.ns, token_ids, start, end)
        before, errors = self._hits(), self._client_errors()
        try:
            payloads = self.client.load(self.ns, hashes)
        except Exception:
            log.exception("load failed; recomputing")
            self.stats.errors += 1
            return start
        n = loaded_prefix(payloads)
        self.stats.blocks_failed += len(payloads) - n
        if self._client_errors() == errors:  # missing or corrupt: the recomputed copies are stored again
            self._known.forget(hashes[n:])
        if n:
            table = self._table(page_ids[: n * self._pages_per_block], kv_cache.device)
            blocks = torch.stack(payloads[:n]).to(device=kv_cache.device, dtype=kv_cache.dtype)
            scatter_blocks(blocks, table, kv_cache)
            self._known.add(hashes[:n])
        self.stats.blocks_loaded += n
        self._add_hits(before)
        return start + n * bt

    def save(self, token_ids: list[int], num_tokens: int, page_ids: list[int], kv_cache: torch.Tensor) -> None:
        n_blocks = min(num_tokens // self.block_tokens, len(page_ids) // self._pages_per_block)
        if n_blocks == 0:
            return
        hashes = block_hashes(self.ns, token_ids, 0, n_blocks * self.block_tokens)
        new = self._known.new(hashes)
        if not new:
            return
        ppb = self._pages_per_block
        try:  # the gather too: an error here reached the engine's step and failed every request in it
            table = self._table([p for i in new for p in page_ids[i * ppb:(i + 1) * ppb]], kv_cache.device)
            blocks = gather_blocks(kv_cache, table).cpu()
            self.client.store(self.ns, [hashes[i] for i in new], blocks)
        except Exception:  # dispatch boundary: a failed offload only costs a future miss
            log.exception("store of %d blocks failed", len(new))
            self.stats.errors += 1
            return
        self.stats.blocks_saved += len(new)
        self._known.add(hashes[i] for i in new)

    def close(self) -> None:
        self.client.close()

    def _table(self, pages: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.int64, device=device).view(-1, self._pages_per_block)

    def _hits(self) -> dict[str, int]:
        try:
            return {name: s.get("hits", 0) for name, s in self.client.stats().items()}
        except Exception:  # stats are informational
            return {}

    def _add_hits(self, before: dict[str, int]) -> None:
        for name, hits in self._hits().items():
            delta = hits - before.get(name, 0)
            if delta:
                self.stats.tier_hits[name] = self.stats.tier_hits.get(name, 0) + delta
