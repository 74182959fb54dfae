"""Continuous batching with chunked prefill and preemption by recompute.

Every step gets a token budget (`max_num_batched_tokens`). Running sequences
are served first, in admission order: a decode takes one token, an unfinished
prefill takes what is left of the budget. When a running sequence needs a page
and none is free, the most recently admitted sequence is preempted: its pages
are released (cached full pages stay matchable) and it goes back to the front
of the queue to be recomputed. Waiting sequences are admitted while budget,
sequence slots and pages last.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_connector import KVConnector
from engine.sequence import Sequence, SeqStatus

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, number of new tokens to compute)


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, kv_cache: torch.Tensor,
                 eos_token_ids: tuple[int, ...], connector: KVConnector | None = None) -> None:
        self.cfg, self.blocks, self.kv_cache = cfg, blocks, kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Choose this step's (sequence, new tokens) pairs."""
        budget = self.cfg.max_num_batched_tokens
        batch: ScheduledBatch = []
        preemptions = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n):
                break
            batch.append((seq, n))
            budget -= n
            i += 1
        # admitting while others were just preempted would only thrash
        while self.waiting and budget > 0 and self.num_preemptions == preemptions \
                and len(self.running) < self.cfg.max_num_seqs:
            n = self._admit(self.waiting[0], budget)
            if n is None:
                break
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Pages for `seq`'s next n tokens, preempting the newest sequences as needed.

        False when `seq` itself had to be preempted."""
        while not self.blocks.ensure_pages(seq, seq.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Match cached prefixes and allocate the first chunk; None when pages are short."""
        local = self.blocks.match_prefix(seq)
        start = end = local
        if self.connector is not None:
            bt = self.connector.block_tokens
            cap = (seq.num_tokens - 1) // bt * bt  # the last token is always computed
            external = min(self.connector.num_cached_tokens(seq.token_ids), cap)
            if external > local:
                start, end = local // bt * bt, external
                self.blocks.truncate(seq, start // self.blocks.page_size)
        n = min(seq.num_tokens - end, budget)
        if not self.blocks.ensure_pages(seq, end + n):
            self.blocks.free(seq)
            return None
        computed = end
        if end > start:
            ps = self.blocks.page_size
            pages = seq.page_table[start // ps : end // ps]
            computed = self.connector.load(seq.token_ids, start, end, pages, self.kv_cache)
            assert start <= computed <= end, f"connector loaded up to {computed}, outside [{start}, {end}]"
            n = min(seq.num_tokens - computed, budget, len(seq.page_table) * ps - computed)
        if not seq.admitted:  # as vLLM counts them: once (a preempted sequence matches its own pages again)
            seq.num_local_cached_tokens = min(local, start, seq.num_prompt_tokens)
            seq.num_cached_tokens = max(0, min(computed, seq.num_prompt_tokens) - seq.num_local_cached_tokens)
            seq.admitted = True
        seq.num_computed_tokens = computed
        self.blocks.commit(seq)
        return n

    def update(self, batch: ScheduledBatch, sampled: dict[Sequence, int]) -> list[Sequence]:
        """Advance the batch after a forward; append sampled tokens; return the sequences that finished."""
        finished = []
        now = time.perf_counter()
        for seq, n in batch:
            was_prefill = n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
            if was_prefill and self.connector is not None:
                self.connector.save(seq.token_ids, seq.num_computed_tokens, seq.page_table, self.kv_cache)
            if seq not in sampled:
                continue  # a prefill chunk short of the end produces no token
            seq.token_ids.append(sampled[seq])
            if seq.first_token_s is None:
                seq.first_token_s = now
            seq.finish_reason = self._stop_reason(seq, sampled[seq])
            if seq.finish_reason is not None:
                self._finish(seq, now)
                finished.append(seq)
        return finished

    def abort(self, seq: Sequence) -> None:
        """Take `seq` out of the queue or the running batch (its KV so far is saved)."""
        if seq.is_finished:
            return
        seq.finish_reason = seq.finish_reason or "abort"
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.blocks.free(seq)  # pages an admission took before it failed (a connector that raised)
            seq.status, seq.finish_s = SeqStatus.FINISHED, time.perf_counter()
        else:
            self._finish(seq, time.perf_counter())

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, now: float) -> None:
        if self.connector is not None:
            self.connector.save(seq.token_ids, seq.num_computed_tokens, seq.page_table, self.kv_cache)
        seq.status = SeqStatus.FINISHED
        seq.finish_s = now
        self.running.remove(seq)
        self.blocks.free(seq)
