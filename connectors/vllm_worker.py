"""Worker side of the vLLM connector: move KV between vLLM's pages and the store.

vLLM-free on purpose: it takes the per-layer cache tensors vLLM registers
and the `Transfer`s the scheduler side planned. Two cache layouts are
understood (see ``kernels/layouts.py``):

- CPU attention: per layer ``(num_pages, kv_heads, page_tokens, 2 * head_dim)``,
  each (page, head) an ISA-packed K/V region;
- CUDA flash-attention: per layer ``[2, num_pages, page_tokens, kv_heads, head_dim]``.

Both are gathered into canonical pages ``[n, L, 2, page_tokens, H, D]`` and
regrouped into store blocks ``[m, L, 2, block_tokens, H, D]`` (and back), so
the store holds the engine-neutral layout of docs/hash-spec.md whatever the
backend. Inside a CPU page vLLM packs K and V per ISA (`CpuPageLayout`);
flash pages go through ``kernels/layouts.py``.

Loads run before the forward that needs them; a block that is missing or
fails its checksum ends the loaded prefix, and the pages from there on are
reported so vLLM recomputes them. Saves run after the forward: one gather,
then `client.store`, which copies into the store's host tier and returns;
lower tiers are written in the background, so a step never waits on disk.
"""
from __future__ import annotations

import logging
import re
import socket
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from cache_service.keys import KV_DTYPES, Namespace, prefix_hashes
from connectors.client import CacheClient
from connectors.vllm_scheduler import LOOKUP_REPLY, Transfer, read_request
from tiers.types import ConfigError

log = logging.getLogger("vllm.tierkv")  # under vLLM's logger, so its handler shows our lines


@dataclass(slots=True)
class WorkerStats:
    """Cumulative counters of the worker side (one vLLM worker)."""

    loads: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0
    pages_invalid: int = 0
    blocks_saved: int = 0  # handed to the store
    blocks_new: int = 0  # of those, new to the store's top tier
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_s: float = 0.0
    save_s: float = 0.0
    errors: int = 0


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
    element (kv, t, d) in that region; `connectors.vllm` learns it from
    vLLM's own cache writer. Known packings get strided fast paths.
    """

    def __init__(self, index: Tensor) -> None:
        two, page, dim = index.shape
        flat = index.reshape(-1).to(torch.int64)
        if two != 2 or not torch.equal(torch.sort(flat).values, torch.arange(flat.numel())):
            raise ConfigError(f"CPU page layout index {tuple(index.shape)} is not a permutation of one region")
        self.page, self.dim, self.index = page, dim, flat
        self.inverse = torch.argsort(flat)
        ar = torch.arange(flat.numel()).view(2, page, dim)
        k_t = torch.stack([torch.arange(page * dim).view(dim, page).t(), ar[1]])
        self.kind = "tokens" if torch.equal(flat, ar.reshape(-1)) else \
            "k_transposed" if torch.equal(flat, k_t.reshape(-1)) else "permuted"

    @classmethod
    def tokens(cls, page: int, dim: int) -> "CpuPageLayout":
        return cls(torch.arange(2 * page * dim).view(2, page, dim))

    def views(self, regions: Tensor) -> tuple[Tensor, Tensor] | None:
        """K and V of ``[n, H, 2 * page * D]`` regions as ``[n, H, page, D]``
        views (writable), or None for a packing that is no strided view."""
        n, heads, _ = regions.shape
        half = self.page * self.dim
        v = regions[..., half:].view(n, heads, self.page, self.dim)
        if self.kind == "tokens":
            return regions[..., :half].view(n, heads, self.page, self.dim), v
        if self.kind == "k_transposed":
            return regions[..., :half].view(n, heads, self.dim, self.page).transpose(-1, -2), v
        return None


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

    def read_blocks(self, page_ids: list[int], tokens: int) -> Tensor:
        """Pages `page_ids` as canonical blocks ``[n * page // tokens, L, 2, tokens, H, D]``
        (or ``[n * page // tokens]`` merged when tokens > page). The result is
        a reused buffer: valid until the next call."""
        if self.kind == "flash" or self.page % tokens:
            return regroup(self._gather(page_ids), tokens)
        n, k, L = len(page_ids), self.page // tokens, len(self.layers)
        out = self._buf("blocks", (n * k, L, 2, tokens, self.heads, self.dim))
        o = out.view(n, k, L, 2, tokens, self.heads, self.dim)
        for i, regions in self._regions(page_ids):
            kv = self._kv(regions)
            for j in range(2):  # [n, H, page, D] -> [n, k, tokens, H, D]
                o[:, :, i, j].copy_(kv[j].reshape(n, self.heads, k, tokens, self.dim).permute(0, 2, 3, 1, 4))
        return out

    def write_blocks(self, blocks: list[Tensor], page_ids: list[int]) -> None:
        """Write canonical blocks (each ``[L, 2, tokens, H, D]``, covering the pages in order) into `page_ids`.
        Staged one layer at a time, so the staging memory stays small."""
        tokens = blocks[0].shape[2]
        if self.kind == "flash" or self.page % tokens:
            self._scatter(regroup(torch.stack(blocks), self.page), page_ids)
            return
        n, k, heads, dim = len(page_ids), self.page // tokens, self.heads, self.dim
        assert len(blocks) == n * k, (len(blocks), n, k)
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        regions = self._buf("regions", (n, heads, 2 * self.page * dim))
        stage = self._buf("layer", (n, k, 2, tokens, heads, dim))
        views = self.cpu.views(regions)
        tok = None if views else self._buf("tokens", (n, heads, 2, self.page, dim))
        dst = views or (tok[:, :, 0], tok[:, :, 1])
        batch = _as_batch(blocks)  # blocks laid out evenly in one buffer: read in place, no staging copy
        for i, layer in enumerate(self.layers):
            if batch is not None:
                src = batch[:, i].view(n, k, 2, tokens, heads, dim)
            else:
                torch.stack([b[i] for b in blocks], out=stage.view(n * k, 2, tokens, heads, dim))
                src = stage
            for j in range(2):  # [n, k, tokens, H, D] -> [n, H, page, D]
                dst[j].view(n, heads, k, tokens, dim).copy_(src[:, :, j].permute(0, 3, 1, 2, 4))
            if tok is not None:
                torch.index_select(tok.view(n, heads, -1), 2, self.cpu.inverse, out=regions)
            layer.view(layer.shape[0], heads, -1).index_copy_(0, ids, regions)

    def reserve(self, tokens: int) -> None:
        """Allocate and touch the save buffer for `tokens` tokens now (at startup), not in a request."""
        if self.kind == "cpu":
            n = -(-tokens // self.page)
            self._buf("blocks", (n * self.page, len(self.layers), 2, self.heads, self.dim)).zero_()

    def _regions(self, page_ids: list[int]):
        """Per layer: (index, ``[n, H, 2 * page * D]`` copy of its pages) in a reused buffer."""
        ids = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        regions = self._buf("regions", (len(page_ids), self.heads, 2 * self.page * self.dim))
        for i, layer in enumerate(self.layers):
            torch.index_select(layer.view(layer.shape[0], self.heads, -1), 0, ids, out=regions)
            yield i, regions

    def _kv(self, regions: Tensor) -> tuple[Tensor, Tensor]:
        views = self.cpu.views(regions)
        if views is not None:
            return views
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


def _as_batch(blocks: list[Tensor]) -> Tensor | None:
    """``torch.stack(blocks)`` as a view, when the blocks are same-shaped
    contiguous views spaced evenly in one buffer (a daemon's shared-memory
    load hands them out so); None otherwise."""
    first = blocks[0]
    step, item = (blocks[1].data_ptr() - first.data_ptr() if len(blocks) > 1 else 0), first.element_size()
    if step < 0 or step % item or not first.is_contiguous():
        return None
    base = first.untyped_storage().data_ptr()
    for i, b in enumerate(blocks):
        if (b.data_ptr() != first.data_ptr() + i * step or b.shape != first.shape or b.dtype != first.dtype
                or not b.is_contiguous() or b.untyped_storage().data_ptr() != base):
            return None
    return first.as_strided((len(blocks), *first.shape), (step // item, *first.stride()))


def _layer_index(name: str) -> int:
    nums = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(nums[0]) if nums else -1


class WorkerSide:
    """Executes one step's `Transfer`s against the registered KV cache."""

    def __init__(self, client: CacheClient, ns: Namespace, page_tokens: int) -> None:
        self.client, self.ns, self.page = client, ns, page_tokens
        self.bt = ns.block_tokens
        self.kv: PagedKV | None = None
        self.stats = WorkerStats()
        self._invalid_pages: set[int] = set()
        self._failed: dict[str, int] = {}  # req_id -> tokens actually loaded (this step)

    def register(self, kv_caches: dict[str, Tensor], cpu_layout: CpuPageLayout | None = None,
                 reserve_tokens: int = 0) -> None:
        """Adopt vLLM's per-layer caches (and, for the CPU backend, its page
        layout); checks they match the namespace. `reserve_tokens`: the most
        tokens one step saves, whose buffer is prepared now."""
        kv = PagedKV(kv_caches, self.ns.kv_heads, self.ns.head_dim, self.page, cpu_layout)
        dtype = str(kv.dtype).removeprefix("torch.")
        if len(kv.layers) != self.ns.num_layers or dtype != self.ns.kv_dtype or dtype not in KV_DTYPES:
            raise ConfigError(f"registered KV cache ({len(kv.layers)} layers, {dtype}) differs from the "
                              f"namespace ({self.ns.num_layers} layers, {self.ns.kv_dtype})")
        self.kv = kv
        kv.reserve(reserve_tokens)
        log.info("tierkv: %d layers of %s KV, %s layout, pages of %d tokens, store blocks of %d",
                 len(kv.layers), dtype, kv.kind, self.page, self.bt)

    def namespace(self, tenant: str) -> Namespace:
        return self.ns if tenant == self.ns.tenant_salt else self.ns.with_tenant(tenant)

    # --------------------------------------------------------------- loads
    def load(self, transfers: list[Transfer]) -> None:
        for t in transfers:
            t0 = time.perf_counter()
            good = self._load_one(t)
            self.stats.load_s += time.perf_counter() - t0
            self.stats.loads += 1
            if good < t.end:
                first_bad = (good - t.start) // self.page
                self._invalid_pages.update(t.page_ids[first_bad:])
                self.stats.pages_invalid += len(t.page_ids) - first_bad
                self._failed[t.req_id] = good

    def _load_one(self, t: Transfer) -> int:
        """Load tokens [t.start, t.end); returns the end of what was loaded."""
        assert self.kv is not None, "register_kv_caches must come first"
        ns = self.namespace(t.tenant)
        hashes = prefix_hashes(ns, t.token_ids[: t.end])[t.start // self.bt:]
        try:
            payloads = self.client.load(ns, hashes)
        except Exception:  # dispatch boundary: a failed load is recomputed, never fatal
            log.exception("tierkv: load of %d blocks failed; vLLM recomputes them", len(hashes))
            self.stats.errors += 1
            payloads = [None] * len(hashes)
        n_ok = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        align = max(self.page, self.bt)
        tokens_ok = n_ok * self.bt // align * align
        self.stats.blocks_failed += len(payloads) - n_ok
        if tokens_ok:
            n = tokens_ok // self.bt
            self.kv.write_blocks(payloads[:n], t.page_ids[: tokens_ok // self.page])
            self.stats.blocks_loaded += tokens_ok // self.bt
            self.stats.bytes_loaded += n * self.ns.payload_bytes
        return t.start + tokens_ok

    @property
    def failed(self) -> dict[str, int]:
        """Requests whose load stopped short in this step: req_id -> tokens loaded."""
        return dict(self._failed)

    def take_invalid_pages(self) -> set[int]:
        out, self._invalid_pages = self._invalid_pages, set()
        return out

    def take_failed(self) -> dict[str, int]:
        out, self._failed = self._failed, {}
        return out

    # --------------------------------------------------------------- saves
    def save(self, transfers: list[Transfer]) -> None:
        """Store the planned blocks. A request whose load failed in this step
        is skipped: its new KV was computed on bad context, and vLLM recomputes it."""
        for t in transfers:
            if t.req_id in self._failed:
                continue
            t0 = time.perf_counter()
            try:
                self._save_one(t)
            except Exception:  # dispatch boundary: a failed offload only costs a future miss
                log.exception("tierkv: save of tokens [%d, %d) failed", t.start, t.end)
                self.stats.errors += 1
            self.stats.save_s += time.perf_counter() - t0

    def _save_one(self, t: Transfer) -> None:
        assert self.kv is not None, "register_kv_caches must come first"
        ns = self.namespace(t.tenant)
        first_page = t.start // self.page
        # pages may start before `start` (a partly saved page): skip the store blocks already saved
        blocks = self.kv.read_blocks(t.page_ids, self.bt)
        skip = (t.start - first_page * self.page) // self.bt
        n = (t.end - t.start) // self.bt
        blocks = blocks[skip: skip + n]
        if blocks.device.type != "cpu":
            blocks = blocks.cpu()
        hashes = prefix_hashes(ns, t.token_ids[: t.end])[t.start // self.bt:]
        assert len(hashes) == n == blocks.shape[0], (len(hashes), n, tuple(blocks.shape))
        new = self.client.store(ns, hashes, list(blocks))
        self.stats.blocks_saved += n
        self.stats.blocks_new += int(new or 0)
        self.stats.bytes_saved += blocks.numel() * blocks.element_size()


class LookupServer:
    """Answers a scheduler's lookups against the store this worker owns
    (see `connectors.vllm_scheduler.RemoteLookup`). One thread per connection."""

    def __init__(self, client: CacheClient, address: str) -> None:
        self.client, self.address = client, address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(address)  # abstract: no file to clean up, gone with the process
        self._sock.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="tierkv-lookup", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="tierkv-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed:
                try:
                    hashes = read_request(conn)
                except (OSError, ConnectionError):
                    return
                try:
                    held = self.client.lookup(hashes)
                except Exception:  # dispatch boundary: a failing store answers "nothing held"
                    log.exception("tierkv: lookup for the scheduler failed")
                    held = 0
                try:
                    conn.sendall(LOOKUP_REPLY.pack(held))
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
