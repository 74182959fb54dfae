"""Owns the weights and the paged KV cache; turns a scheduled batch into logits.

The KV cache is ONE tensor ``[num_layers, 2, num_pages, page_size,
num_kv_heads, head_dim]`` (dim 1: 0 = K, 1 = V). The KV connector and the
gather/scatter kernels address pages of it directly, so this layout is a
contract.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.config import EngineConfig, ModelConfig
from engine.model import load_model
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, path: Path, model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model_cfg, self.engine_cfg = model_cfg, engine_cfg
        self.dtype, self.device = dtype, device
        self.page_size = engine_cfg.page_size
        self.model = load_model(path, model_cfg, dtype, device)
        shape = (model_cfg.num_layers, 2, engine_cfg.num_pages, self.page_size, model_cfg.num_kv_heads,
                 model_cfg.head_dim)
        # zeros, not empty: padded decode slots read pages that may never have been written,
        # and masked-out garbage can still be NaN, which survives a zero attention weight
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Forward one step. Returns the sequences that reached their last token and their logits."""
        batch = sorted(batch, key=lambda item: item[1] != 1)  # single-token spans first (batched decode)
        input_ids, positions, meta, rows, done = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if not rows:
            return [], torch.empty(0)
        rows_t = torch.tensor(rows, device=self.device)
        return done, self.model.compute_logits(hidden[rows_t])

    def _prepare(self, batch: ScheduledBatch):
        ids, pos, slots, rows, done, prefills = [], [], [], [], [], []
        decodes: list[tuple[Sequence, int]] = []
        row = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            p = torch.arange(start, start + n)
            table = torch.tensor(seq.page_table)
            ids.append(torch.tensor(seq.token_ids[start : start + n]))
            pos.append(p)
            slots.append(table[p // self.page_size] * self.page_size + p % self.page_size)
            if n == 1:
                decodes.append((seq, start + 1))
            else:
                prefills.append(self._prefill_span(row, start, n, table))
            if start + n == seq.num_tokens:
                rows.append(row + n - 1)
                done.append(seq)
            row += n
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev), num_decodes=len(decodes),
            decode_slots=None, decode_mask=None, prefills=prefills,
        )
        if decodes:
            meta.decode_slots, meta.decode_mask = self._decode_index(decodes)
        return torch.cat(ids).to(dev), torch.cat(pos).to(dev), meta, rows, done

    def _prefill_span(self, row: int, start: int, n: int, table: torch.Tensor) -> PrefillSpan:
        if start == 0:  # no earlier context: attend within the chunk, plain causal
            return PrefillSpan(row, row + n, None, None)
        ctx = torch.arange(start + n)
        ctx_slots = table[ctx // self.page_size] * self.page_size + ctx % self.page_size
        mask = None
        if self.device.type != "cpu":  # SDPA's is_causal aligns top-left, wrong with a cached prefix
            mask = (ctx[None, :] <= torch.arange(start, start + n)[:, None]).to(self.device)
        return PrefillSpan(row, row + n, ctx_slots.to(self.device), mask)

    def _decode_index(self, decodes: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ps = self.page_size
        lens = torch.tensor([ctx for _, ctx in decodes])
        max_pages = -(-int(lens.max()) // ps)
        tables = torch.zeros(len(decodes), max_pages, dtype=torch.long)
        for i, (seq, ctx) in enumerate(decodes):
            used = -(-ctx // ps)
            tables[i, :used] = torch.tensor(seq.page_table[:used])
        slots = (tables[:, :, None] * ps + torch.arange(ps)).flatten(1)
        mask = torch.arange(max_pages * ps)[None, :] < lens[:, None]
        return slots.to(self.device), mask[:, None, None, :].to(self.device)
