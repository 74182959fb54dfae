"""vLLM's paged KV cache as the connector reads and writes it (vLLM-free).

Two cache layouts are understood (see ``kernels/layouts.py``):

- CPU attention: per layer ``(num_pages, kv_heads, page_tokens, 2 * head_dim)``,
  each (page, head) an ISA-packed K/V region (`CpuPageLayout`);
- CUDA flash-attention: per layer ``[2, num_pages, page_tokens, kv_heads, head_dim]``.

Both are gathered into canonical pages ``[n, L, 2, page_tokens, H, D]`` and
regrouped into store blocks ``[m, L, 2, block_tokens, H, D]`` (and back), so
the store holds the engine-neutral layout of docs/hash-spec.md whatever the
backend. `connectors/vllm/worker.py` moves those blocks to and from the store.
"""
from __future__ import annotations

import copy
import re
from functools import reduce
from math import gcd
from typing import Callable

import torch
from torch import Tensor

from connectors.vllm.packing import copy_half, strided_halves
from tiers.types import ConfigError


def regroup(x: Tensor, tokens: int) -> Tensor:
    """``[n, L, 2, t, H, D]`` covering ``n * t`` consecutive tokens ->
    ``[n * t // tokens, L, 2, tokens, H, D]`` (a copy unless ``t == tokens``).
    One of `t`, `tokens` must divide the other."""
    n, layers, two, t, heads, dim = x.shape
    if t == tokens:
        return x
    if t % tokens == 0:  # split each page into k store blocks
        k = t // tokens
        y = x.view(n, layers, 2, k, tokens, heads, dim).permute(0, 3, 1, 2, 4, 5, 6)
        return y.reshape(n * k, layers, 2, tokens, heads, dim)
    assert tokens % t == 0 and n % (tokens // t) == 0, (x.shape, tokens)
    p = tokens // t  # merge p pages into one store block
    y = x.view(n // p, p, layers, 2, t, heads, dim).permute(0, 2, 3, 1, 4, 5, 6)
    return y.reshape(n // p, layers, 2, tokens, heads, dim)


class CpuPageLayout:
    """Where vLLM's CPU attention keeps each K/V element of a page.

    The CPU backend views one (page, head) of a layer as a region of
    ``2 * page * head_dim`` elements, K first, and packs each half for its
    ISA: token-major, K transposed to ``[head_dim, page]`` ("vec", "vec16",
    NEON, ...) or AMX tiles. `index[kv, t, d]` is the flat position of
    element (kv, t, d) in that region; `connectors.vllm.connector` learns it from
    vLLM's own cache writer. A packing whose halves are strided maps (every
    one vLLM has: `packing.strided_halves`) is copied with strided views; any
    other goes through a gather (`index_select`) and a staging buffer.
    """

    def __init__(self, index: Tensor, write_tokens: Callable[[Tensor, Tensor, Tensor, Tensor], None] | None = None
                 ) -> None:
        """`write_tokens(layer, key, value, slots)`, if given, is vLLM's own
        writer of token-major ``[T, H, D]`` K and V into a layer's pages at
        token `slots` (page * page_tokens + offset): loads use it, it packs
        faster than strided copies can (AMX's V interleaves single values)."""
        self.write_tokens = write_tokens
        two, page, dim = index.shape
        flat = index.reshape(-1).to(torch.int64)
        if two != 2 or not torch.equal(torch.sort(flat).values, torch.arange(flat.numel())):
            raise ConfigError(f"CPU page layout index {tuple(index.shape)} is not a permutation of one region")
        self.page, self.dim, self.index = page, dim, flat
        self.inverse = torch.argsort(flat)
        self.halves = strided_halves(flat.view(2, page, dim))
        ar = torch.arange(flat.numel()).view(2, page, dim)
        k_t = torch.stack([torch.arange(page * dim).view(dim, page).t(), ar[1]])
        self.kind = "tokens" if torch.equal(flat, ar.reshape(-1)) else \
            "k_transposed" if torch.equal(flat, k_t.reshape(-1)) else "strided" if self.halves else "permuted"

    @classmethod
    def tokens(cls, page: int, dim: int) -> "CpuPageLayout":
        return cls(torch.arange(2 * page * dim).view(2, page, dim))


class PagedKV:
    """vLLM's per-layer KV cache, read and written as canonical store blocks.

    Staging buffers are kept and reused (grow-only): fresh memory costs a
    page fault per 4 KiB on first touch, which on some VMs is as slow as the
    copy itself.
    """

    def __init__(self, kv_caches: dict[str, Tensor], kv_heads: int, head_dim: int, page_tokens: int,
                 cpu_layout: CpuPageLayout | None = None) -> None:
        names = sorted(kv_caches, key=_layer_index)
        self.layers = [kv_caches[n] for n in names]
        first = self.layers[0]
        self.device, self.dtype = first.device, first.dtype
        self.heads, self.dim, self.page = kv_heads, head_dim, page_tokens
        self._bufs: dict[str, Tensor] = {}
        if first.dim() == 4 and tuple(first.shape[1:]) == (kv_heads, page_tokens, 2 * head_dim):
            if cpu_layout is None or (cpu_layout.page, cpu_layout.dim) != (page_tokens, head_dim):
                raise ConfigError("the CPU KV cache layout needs its page layout (CpuPageLayout) to be known")
            self.kind, self.cpu = "cpu", cpu_layout
        elif first.dim() == 5 and first.shape[0] == 2 and tuple(first.shape[2:]) == (page_tokens, kv_heads, head_dim):
            from kernels import layouts  # imported here: triton loads only where a CUDA worker runs

            self.kind, self._flash = "flash", layouts
        else:
            raise ConfigError(
                f"unsupported vLLM KV cache layout {tuple(first.shape)} for layer {names[0]!r}: expected CPU "
                f"(pages, {kv_heads}, {page_tokens}, {2 * head_dim}) or flash (2, pages, {page_tokens}, "
                f"{kv_heads}, {head_dim})")
        for name, layer in zip(names, self.layers):
            if layer.shape != first.shape or layer.dtype != first.dtype or not layer.is_contiguous():
                raise ConfigError(f"layer {name!r} is {tuple(layer.shape)} {layer.dtype}; layers must match "
                                  f"{tuple(first.shape)} {first.dtype} and be contiguous")

    def sibling(self) -> "PagedKV":
        """The same pages with buffers of its own, for another thread."""
        twin = copy.copy(self)
        twin._bufs = {}
        return twin

    def read_blocks(self, page_ids: list[int], tokens: int) -> Tensor:
        """Pages `page_ids` as canonical blocks ``[n * page // tokens, L, 2, tokens, H, D]``
        (or ``[n * page // tokens]`` merged when tokens > page). The result is
        a reused buffer: valid until the next call."""
        if self.kind == "flash" or self.page % tokens:
            return regroup(self._gather(page_ids), tokens)
        n, k, L = len(page_ids), self.page // tokens, len(self.layers)
        out = self._buf("blocks", (n * k, L, 2, tokens, self.heads, self.dim))
        o = out.view(n, k, L, 2, tokens, self.heads, self.dim)
        runs = _runs(page_ids)
        for i, layer in enumerate(self.layers):
            pages = layer.view(layer.shape[0], self.heads, -1)
            for a, b, first in runs:  # read each run of consecutive pages in place
                regions = pages[first: first + b - a]
                if self.cpu.halves is not None:
                    for j in range(2):
                        copy_half(regions, self.cpu.halves[j], o[a:b, :, i, j], into_pages=False)
                    continue
                kv = self._gathered(regions)
                for j in range(2):  # [m, H, page, D] -> [m, k, tokens, H, D]
                    o[a:b, :, i, j].copy_(kv[j].reshape(b - a, self.heads, k, tokens, self.dim).permute(0, 2, 3, 1, 4))
        return out

    def write_blocks(self, blocks: list[Tensor], page_ids: list[int]) -> None:
        """Write canonical blocks (each ``[L, 2, tokens, H, D]``, covering the pages in order) into `page_ids`.
        Each run of consecutive pages is written in place, one layer at a time. The last page may be
        covered in part (a load ending mid-page): its other slots get zeros, which the engine
        overwrites as it computes those tokens (the page is the request's own, past every shared one)."""
        tokens = blocks[0].shape[2]
        k = self.page // tokens
        if k > 1 and len(blocks) % k:
            whole = len(blocks) // k * k
            if whole:
                self.write_blocks(blocks[:whole], page_ids[:whole // k])
            pad = [blocks[0].new_zeros(blocks[0].shape)] * (whole + k - len(blocks))
            self.write_blocks(list(blocks[whole:]) + pad, page_ids[whole // k: whole // k + 1])
            return
        if self.kind == "flash" or self.page % tokens:
            self._scatter(regroup(torch.stack(blocks), self.page), page_ids)
            return
        n, k, heads, dim = len(page_ids), self.page // tokens, self.heads, self.dim
        assert len(blocks) == n * k, (len(blocks), n, k)
        rows = as_rows(blocks)  # blocks in one buffer (a load's segment, the daemon's pool): read in place
        stage = None if rows is not None and rows[1] is None else self._buf("layer", (n * k, 2, tokens, heads, dim))
        if self.cpu.write_tokens is not None:
            self._write_natively(blocks, rows, stage, page_ids)
            return
        runs = _runs(page_ids)
        for i, layer in enumerate(self.layers):
            src, pages = _layer(blocks, rows, i, stage).view(n, k, 2, tokens, heads, dim), \
                layer.view(layer.shape[0], heads, -1)
            for a, b, first in runs:
                self._write_run(src[a:b], pages[first: first + b - a])

    def _write_natively(self, blocks: list[Tensor], rows: tuple[Tensor, Tensor | None] | None,
                        stage: Tensor | None, page_ids: list[int]) -> None:
        """`write_blocks` through vLLM's own cache writer (`CpuPageLayout.write_tokens`):
        each layer's K and V staged token-major ``[T, H, D]``, then packed by vLLM."""
        m, tokens = len(blocks), blocks[0].shape[2]
        slots = (torch.tensor(page_ids, dtype=torch.int64).view(-1, 1) * self.page + torch.arange(self.page)).view(-1)
        kv = self._buf("kv_tokens", (2, m, tokens, self.heads, self.dim))
        for i, layer in enumerate(self.layers):
            if rows is not None and rows[1] is not None:  # scattered rows: gathered straight into the staging
                for j in range(2):
                    torch.index_select(rows[0][:, i, j], 0, rows[1], out=kv[j])
            else:
                src = _layer(blocks, rows, i, stage)
                for j in range(2):  # [m, tokens, H, D] per half: runs of H * D elements
                    kv[j].copy_(src[:, j])
            self.cpu.write_tokens(layer, kv[0].view(-1, self.heads, self.dim), kv[1].view(-1, self.heads, self.dim), slots)

    def _write_run(self, src: Tensor, dst: Tensor) -> None:
        """``[m, k, 2, tokens, H, D]`` blocks -> the ``[m, H, 2 * page * D]`` regions of m consecutive pages."""
        if self.cpu.halves is not None:
            for j in range(2):
                copy_half(dst, self.cpu.halves[j], src[:, :, j], into_pages=True)
            return
        m, k, _, tokens, heads, dim = src.shape  # a packing with no strided view: stage token-major, then permute
        tok = self._buf("tokens", (m, heads, 2, self.page, dim))
        for j in range(2):  # [m, k, tokens, H, D] -> [m, H, page, D]
            tok[:, :, j].view(m, heads, k, tokens, dim).copy_(src[:, :, j].permute(0, 3, 1, 2, 4))
        torch.index_select(tok.view(m, heads, -1), 2, self.cpu.inverse, out=dst)

    def reserve(self, tokens: int) -> None:
        """Allocate and touch the save buffer for `tokens` tokens now (at startup), not in a request."""
        if self.kind == "cpu":
            n = -(-tokens // self.page)
            self._buf("blocks", (n * self.page, len(self.layers), 2, self.heads, self.dim)).zero_()

    def _gathered(self, regions: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of ``[n, H, 2 * page * D]`` regions of a packing with no strided view, as ``[n, H, page, D]``."""
        n = regions.shape[0]
        tok = self._buf("tokens", (n, self.heads, 2, self.page, self.dim))
        torch.index_select(regions, 2, self.cpu.index, out=tok.view(n, self.heads, -1))
        return tok[:, :, 0], tok[:, :, 1]

    def _gather(self, page_ids: list[int]) -> Tensor:
        """Canonical pages ``[n, L, 2, page, H, D]`` (a fresh tensor)."""
        if self.kind == "cpu":
            return self.read_blocks(page_ids, self.page).clone()
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        return self._flash.gather_vllm_flash(self.layers, ids.view(-1, 1))

    def _scatter(self, pages: Tensor, page_ids: list[int]) -> None:
        if self.kind == "cpu":
            self.write_blocks(list(pages.contiguous()), page_ids)
            return
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        self._flash.scatter_vllm_flash(pages.to(device=self.device, dtype=self.dtype).contiguous(),
                                       ids.view(-1, 1), self.layers)

    def _buf(self, name: str, shape: tuple[int, ...]) -> Tensor:
        numel = torch.Size(shape).numel()
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._bufs[name] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return buf[:numel].view(shape)


def _layer(blocks: list[Tensor], rows: tuple[Tensor, Tensor | None] | None, i: int, stage: Tensor | None) -> Tensor:
    """Layer i of the blocks, ``[m, 2, tokens, H, D]``: a view where they are rows of one buffer in
    order (`as_rows`), else gathered into `stage` (one layer's worth, reused)."""
    if rows is None:
        return torch.stack([b[i] for b in blocks], out=stage)
    base, idx = rows
    return base[:, i] if idx is None else torch.index_select(base[:, i], 0, idx, out=stage)


def as_rows(blocks: list[Tensor]) -> tuple[Tensor, Tensor | None] | None:
    """(a ``[rows, *shape]`` strided view over the blocks' one buffer, each
    block's row; None for rows 0..n-1 in order), when the blocks are
    same-shaped contiguous views into one storage whose offsets differ by
    multiples of one stride (a shared pool's slots; evenly spaced objects);
    None otherwise."""
    first = blocks[0]
    base = first.untyped_storage().data_ptr()
    if any(b.shape != first.shape or b.dtype != first.dtype or not b.is_contiguous()
           or b.untyped_storage().data_ptr() != base for b in blocks):
        return None
    offsets = [b.storage_offset() for b in blocks]
    low = min(offsets)
    step = reduce(gcd, (o - low for o in offsets), 0) or first.numel()
    rows = [(o - low) // step for o in offsets]
    view = first.as_strided((max(rows) + 1, *first.shape), (step, *first.stride()), low)
    return view, (None if rows == list(range(len(rows))) else torch.tensor(rows, dtype=torch.int64))


def _runs(page_ids: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, first page id) of each stretch of `page_ids` whose ids are consecutive."""
    runs, a = [], 0
    for b in range(1, len(page_ids) + 1):
        if b == len(page_ids) or page_ids[b] != page_ids[b - 1] + 1:
            runs.append((a, b, page_ids[a]))
            a = b
    return runs


def _layer_index(name: str) -> int:
    nums = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(nums[0]) if nums else -1
