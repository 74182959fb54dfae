"""Worker side of the vLLM connector: move KV between vLLM's pages and the store.

vLLM-free on purpose: it takes the per-layer cache tensors vLLM registers
(read and written through `connectors/vllm_pages.py`, which knows vLLM's CPU
and flash-attention layouts) and the `Transfer`s the scheduler side planned.

Loads run before the forward that needs them; a block that is missing or
fails its checksum ends the loaded prefix, and the pages from there on are
reported so vLLM recomputes them. Saves run after the forward: one gather,
then `client.store`, which copies into the store's host tier and returns;
lower tiers are written in the background, so a step never waits on disk.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from torch import Tensor

from cache_service.keys import KV_DTYPES, Namespace, prefix_hashes
from connectors.client import CacheClient
from connectors.vllm_pages import CpuPageLayout, PagedKV
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
