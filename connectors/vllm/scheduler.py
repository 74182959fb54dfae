"""Scheduler side of the vLLM connector: what to load and what to save
(and the connector's validated extra config).

vLLM-free on purpose (plain token lists and block ids in, `Transfer`s out),
so the planning rules are testable without an engine. `connectors/vllm/connector.py`
adapts vLLM's objects to these calls.

Units. The store keys blocks of ``block_tokens`` tokens (16 by default, the
same keys our own engine writes); vLLM allocates pages of ``page_tokens``
(128 on CPU, 16 on CUDA). One must divide the other. A load moves whole
store blocks and starts on a page (vLLM's own hit ends on one), so loaded
prefixes are multiples of ``block_tokens``: where pages are larger, its last
page may be loaded in part and vLLM computes the rest of it (a 2,000-token
prefix loads 2,000 tokens, not 1,920). A save moves every full store block
that has KV, which may be part of a page.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cache_service.blocks.keys import Namespace
from connectors.client import CacheClient
from connectors.prefix import full_blocks
from connectors.vllm.clients import CacheNotOpen
from tiers.types import BlockHash, ConfigError

log = logging.getLogger("vllm.tierkv")  # under vLLM's logger, so its handler shows our lines
_LOAD_FAILURE = ("recompute", "fail")


@dataclass(slots=True)
class TierKVConfig:
    """The connector's ``kv_connector_extra_config``, validated."""

    url: str = "local://"
    block_tokens: int = 16
    tenant: str = ""
    load_failure: str = "recompute"
    async_save: bool | str = "auto"  # auto: asynchronous when vLLM's KV cache is on a GPU
    config: str = ""  # the TOML file `tierkv serve` reads: where session manifests live (session hints)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"kv_connector_extra_config.url must be a non-empty string, got {self.url!r}")
        bt = self.block_tokens
        if isinstance(bt, bool) or not isinstance(bt, int) or bt <= 0:
            raise ConfigError(f"kv_connector_extra_config.block_tokens must be a positive int, got {bt!r}")
        if not isinstance(self.config, str):
            raise ConfigError(f"kv_connector_extra_config.config must be a path, got {self.config!r}")
        if not isinstance(self.tenant, str):
            raise ConfigError(f"kv_connector_extra_config.tenant must be a string, got {self.tenant!r}")
        if not isinstance(self.async_save, bool) and self.async_save != "auto":
            raise ConfigError(f"kv_connector_extra_config.async_save must be true, false or \"auto\", "
                              f"got {self.async_save!r}")
        if self.load_failure not in _LOAD_FAILURE:
            raise ConfigError(f"kv_connector_extra_config.load_failure must be one of {_LOAD_FAILURE}, "
                              f"got {self.load_failure!r}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "TierKVConfig":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown} for TierKVConnector "
                              f"(known: {', '.join(cls.__dataclass_fields__)})")
        return cls(**extra)


def request_key(tenant: str, cache_salt: str | None) -> str:
    """The key of a request's blocks: its tenant, then (with a cache salt) a newline and the salt's digest
    in hex. The salt starts the blocks' hash chain (as vLLM's prefix cache mixes it into the first block),
    the namespace stays the tenant's: as a tenant name a salt was refused by a daemon (a newline also failed
    the namespace's own check, which stopped vLLM's engine), and per-salt namespaces would each cost an S3
    tier a GET per load of an unknown block. A digest: vLLM lets any character but @ / \\ NUL through."""
    if not cache_salt:
        return tenant
    return f"{tenant}\n{hashlib.sha256(cache_salt.encode('utf-8', 'surrogatepass')).hexdigest()}"


def salted(key: str) -> bool:
    """Whether a request's key (`request_key`) has a cache salt."""
    return "\n" in key


def key_space(ns: Namespace, key: str) -> tuple[Namespace, bytes]:
    """The namespace and chain salt of a request's key (`request_key`)."""
    tenant, _, salt = key.partition("\n")
    return (ns if tenant == ns.tenant_salt else ns.with_tenant(tenant)), bytes.fromhex(salt)


@dataclass(slots=True)
class Transfer:
    """One request's KV move between vLLM pages and the store.

    Tokens ``[start, end)`` move; ``token_ids`` is the prefix ``[0, end)``
    (block hashes chain over it). ``page_ids`` are vLLM block ids covering
    tokens ``[start // page_tokens * page_tokens, end)`` in order.
    """

    req_id: str
    token_ids: list[int]
    start: int
    end: int
    page_ids: list[int]
    tenant: str = ""


@dataclass(slots=True)
class _Request:
    tokens: Sequence[int]  # live view of the request's token ids (grows while decoding)
    tenant: str
    stored: int = 0  # tokens [0, stored) are in the store or queued for it
    local: int = 0  # tokens vLLM's own prefix cache supplied at the last lookup
    hashes: list[BlockHash] = field(default_factory=list)  # memo for lookups
    load: tuple[int, int] | None = None  # tokens to load at the next step
    load_pages: list[int] = field(default_factory=list)
    saving: bool = False  # a save was planned: the worker reports the request when its saves are done


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters of the scheduler side."""

    lookups: int = 0
    lookup_errors: int = 0
    hit_tokens: int = 0  # tokens vLLM was told to load
    load_failures: int = 0  # requests whose load failed (in part) and were recomputed


class SchedulerSide:
    """Plans loads and saves for vLLM requests against one store namespace."""

    def __init__(self, client: CacheClient, ns: Namespace, page_tokens: int) -> None:
        bt = ns.block_tokens
        if page_tokens % bt and bt % page_tokens:
            raise ValueError(f"block_tokens {bt} and vLLM block_size {page_tokens}: one must divide the other")
        self.client, self.ns, self.page = client, ns, page_tokens
        self.bt = bt
        self._reqs: dict[str, _Request] = {}
        self.stats = SchedulerStats()
        self.step = 0  # plans made: each step's plan carries its number (WorkerSide.load)
        self.heard = 0  # the last step whose failed loads were reported: each plan carries it (WorkerSide.save)

    def namespace(self, key: str) -> Namespace:
        return key_space(self.ns, key)[0]

    # ----------------------------------------------------------- admission
    def knows(self, req_id: str) -> bool:
        """Whether the request was looked up before (vLLM asks again while it waits, and after a preemption)."""
        return req_id in self._reqs

    def matched_tokens(self, req_id: str, tokens: Sequence[int], num_computed: int, tenant: str) -> int:
        """Tokens beyond `num_computed` (vLLM's own page-aligned hit) that the
        store can supply. Never the whole prompt (vLLM must compute at least
        one token for logits); a multiple of block_tokens. Only memoizes: repeated
        calls give the same answer while the store does."""
        st = self._reqs.get(req_id)
        if st is None or st.tenant != tenant:
            st = self._reqs[req_id] = _Request(tokens, tenant)
        n = len(tokens)
        self.stats.lookups += 1
        try:
            if len(st.hashes) != n // self.bt:
                ns, salt = key_space(self.ns, tenant)
                st.hashes = full_blocks(ns, tokens, salt)
            held = self.client.lookup(st.hashes)
        except Exception as e:  # dispatch boundary: an unusable store is a miss, never an error
            if not isinstance(e, CacheNotOpen):  # (that one is logged where it is retried)
                log.exception("lookup failed; treating as a miss")
            self.stats.lookup_errors += 1
            held = 0
        st.stored, st.local = held * self.bt, num_computed
        if num_computed % self.bt:  # vLLM's own hit ends inside a store block (blocks larger than pages):
            return 0  # a load starts on a block, or its blocks would land a page off
        usable = min(held, (n - 1) // self.bt) * self.bt
        return max(0, usable - num_computed)

    def allocated(self, req_id: str, page_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated pages for `req_id` and accepted `num_external` tokens from us."""
        st = self._reqs.get(req_id)
        if st is None or num_external <= 0:
            return
        start, end = st.local, st.local + num_external
        assert start % self.page == 0 and end % self.bt == 0, (start, end)
        st.load = (start, end)
        st.load_pages = list(page_ids[start // self.page: -(-end // self.page)])  # the last one may be in part
        self.stats.hit_tokens += num_external

    # ----------------------------------------------------------- each step
    def plan(self, scheduled: Sequence[tuple[str, int, int]],
             page_ids_of: Callable[[str], Sequence[int]]) -> tuple[list[Transfer], list[Transfer]]:
        """Loads and saves for one step.

        `scheduled` holds ``(req_id, num_computed_before_step, num_scheduled)``
        per request in the step; `page_ids_of(req_id)` gives its pages.
        A save covers every full store block that will have KV after the
        step and is not in the store yet. The step's number is `self.step` after.
        """
        self.step += 1
        loads: list[Transfer] = []
        saves: list[Transfer] = []
        for req_id, computed, scheduled_now in scheduled:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if st.load is not None:
                start, end = st.load
                loads.append(Transfer(req_id, list(st.tokens[:end]), start, end, st.load_pages, st.tenant))
                st.load, st.load_pages = None, []
                st.stored = max(st.stored, end)
            full = min(computed + scheduled_now, len(st.tokens)) // self.bt * self.bt
            if full > st.stored:
                pages = page_ids_of(req_id)
                first, last = st.stored // self.page, -(-full // self.page)
                saves.append(Transfer(req_id, list(st.tokens[:full]), st.stored, full,
                                      list(pages[first:last]), st.tenant))
                st.stored, st.saving = full, True
        return loads, saves

    def load_failed(self, req_id: str, good_tokens: int, step: int) -> None:
        """A worker loaded only `good_tokens` of the prefix in step `step`; vLLM
        recomputes the rest, and those blocks must be saved again."""
        self.stats.load_failures += 1
        self.heard = max(self.heard, step)
        st = self._reqs.get(req_id)
        if st is not None:
            st.stored = min(st.stored, good_tokens)

    def finished(self, req_id: str) -> bool:
        """Forget `req_id`; True when a save was planned for it (the workers report its end)."""
        st = self._reqs.pop(req_id, None)
        return st is not None and st.saving
