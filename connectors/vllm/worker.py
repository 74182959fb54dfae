"""Worker side of the vLLM connector: move KV between vLLM's pages and the store.

vLLM-free on purpose: it takes the per-layer cache tensors vLLM registers
(read and written through `connectors/vllm/pages.py`, which knows vLLM's CPU
and flash-attention layouts) and the `Transfer`s the scheduler side planned.

Loads run before the forward that needs them; a block that is missing or
fails its checksum ends the loaded prefix, and the pages from there on are
reported so vLLM recomputes them. A save is one gather from the pages, then
`client.store`, which copies into the store's host tier; lower tiers are
written by the store's own background writers, so no step waits on disk.
Saves run after the forward, in the step (the default on CPU), or queued to
a background thread (`SaveQueue`, the default on GPU): then a finished
request's pages stay with us until its saves have read them (vLLM's delayed
free: `request_finished` returns True, `get_finished` reports the request),
and a preempted request's saves finish before its pages can be reused.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cache_service.blocks.keys import KV_DTYPES, Namespace
from connectors.client import CacheClient
from connectors.prefix import block_hashes, loaded_prefix
from connectors.vllm.clients import CacheNotOpen
from connectors.vllm.pages import CpuPageLayout, PagedKV
from connectors.vllm.scheduler import Transfer, key_space
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
    blocks_unsaved: int = 0  # not saved: computed while a failed load's pages may have been read
    blocks_new: int = 0  # of those, new to the store's top tier
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_s: float = 0.0
    save_s: float = 0.0  # spent saving (on the save thread when saves are asynchronous)
    save_wait_s: float = 0.0  # a step spent waiting for saves (preemptions, synchronous saves)
    errors: int = 0


class WorkerSide:
    """Executes one step's `Transfer`s against the registered KV cache."""

    def __init__(self, client: CacheClient, ns: Namespace, page_tokens: int, async_save: bool = False,
                 ranks: Any = None) -> None:
        self.client, self.ns, self.page = client, ns, page_tokens
        self.bt = ns.block_tokens
        self.kv: PagedKV | None = None
        self._reader: PagedKV | None = None  # the save thread's view of the pages: its own buffers
        self.stats = WorkerStats()
        self._invalid_pages: set[int] = set()
        self._failed: dict[str, int] = {}  # req_id -> tokens actually loaded (this step)
        self._taint: int | None = None  # the last step in which a load failed here, until the scheduler heard of it
        self.failed_step = 0  # the step of the loads in `failed`
        self._ranks = ranks  # the TP ranks' (gloo) group: a load failed on one taints them all
        self.saves = SaveQueue(self._save_one, self.stats) if async_save else None

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
        self._reader = kv.sibling() if self.saves is not None else kv
        self._reader.reserve(reserve_tokens)
        log.info("tierkv: %d layers of %s KV, %s layout, pages of %d tokens, store blocks of %d",
                 len(kv.layers), dtype, kv.kind, self.page, self.bt)

    # --------------------------------------------------------------- loads
    def load(self, transfers: list[Transfer], step: int = 1) -> None:
        """Load the blocks of step number `step` (the scheduler's plans count from 1; see `save`)."""
        for t in transfers:
            t0 = time.perf_counter()
            try:
                good = self._load_one(t)
            except Exception:  # dispatch boundary: pages that could not be written are recomputed
                log.exception("tierkv: writing the blocks of tokens [%d, %d) failed; vLLM recomputes them",
                              t.start, t.end)
                self.stats.errors += 1
                good = t.start
            dt = time.perf_counter() - t0
            self.stats.load_s += dt
            self.stats.loads += 1
            log.info("tierkv: loaded %d of %d tokens in %.1f ms", good - t.start, t.end - t.start, dt * 1e3)
            if good < t.end:
                first_bad = (good - t.start) // self.page
                self._invalid_pages.update(t.page_ids[first_bad:])
                self.stats.pages_invalid += len(t.page_ids) - first_bad
                self._failed[t.req_id] = good
                self.taint(step)
                self.failed_step = step

    def _load_one(self, t: Transfer) -> int:
        """Load tokens [t.start, t.end); returns the end of what was loaded."""
        assert self.kv is not None, "register_kv_caches must come first"
        ns, salt = key_space(self.ns, t.tenant)
        hashes = block_hashes(ns, t.token_ids, t.start, t.end, salt)
        try:
            payloads = self.client.load(ns, hashes)
        except Exception as e:  # dispatch boundary: a failed load is recomputed, never fatal
            if not isinstance(e, CacheNotOpen):  # (that one is logged where it is retried)
                log.exception("tierkv: load of %d blocks failed; vLLM recomputes them", len(hashes))
            self.stats.errors += 1
            payloads = [None] * len(hashes)
        n_ok = loaded_prefix(payloads)
        whole = max(self.page, self.bt)  # a short load ends on a page: vLLM recomputes from the first bad one
        tokens_ok = n_ok * self.bt if n_ok == len(payloads) else n_ok * self.bt // whole * whole
        self.stats.blocks_failed += len(payloads) - n_ok
        if tokens_ok:
            n = tokens_ok // self.bt
            self.kv.write_blocks(payloads[:n], t.page_ids[: -(-tokens_ok // self.page)])
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
    def taint(self, step: int) -> None:
        """Pages read in step `step` may be invalid: save nothing until the scheduler heard of it."""
        self._taint = step if self._taint is None else max(self._taint, step)

    def save(self, transfers: list[Transfer], heard: int = 0) -> None:
        """Store the planned blocks (queued, when saves are asynchronous).

        After a load failed here, nothing is saved until a step planned once
        the scheduler heard of it (`heard`, the last step whose failures the
        scheduler had been told of when it planned this one, at or past the
        step of the failure here): until then any request may have read the invalid pages
        (the failed one, one sharing its pages through vLLM's prefix cache,
        its next chunk planned before the failure was reported) and the
        store keeps the first copy of a block, so the recomputed KV could
        never replace it. vLLM recomputes; what goes unsaved is a later miss.
        With tensor parallelism a failed load on any rank taints every rank:
        each rank's KV of the step went through all-reduces over the failed
        rank's invalid pages."""
        if self._ranks is not None and (latest := most_of_ranks(self._taint or 0, self._ranks)):
            self.taint(latest)  # the state, not this step's failure: the failed step may have saved nothing
        if self._tainted(heard):
            self.stats.blocks_unsaved += sum((t.end - t.start) // self.bt for t in transfers)
            if self.saves is not None:
                self.saves.put(transfers, skip={t.req_id for t in transfers})
            return
        if self.saves is not None:
            self.saves.put(transfers)
            return
        t0 = time.perf_counter()
        for t in transfers:
            _run_save(self._save_one, t, self.stats)
        self.stats.save_wait_s += time.perf_counter() - t0

    def _tainted(self, heard: int) -> bool:
        """Whether a step planned having heard of failures up to step `heard` may have read pages
        whose load failed here. A step number, not a count of failures: under async scheduling the
        report of an earlier failure (another request's, another rank's) must not clear a later one."""
        if self._taint is not None and heard >= self._taint:
            self._taint = None  # the scheduler has heard of every failure seen here: vLLM recomputes them
        return self._taint is not None

    def _save_one(self, t: Transfer) -> None:
        assert self._reader is not None, "register_kv_caches must come first"
        ns, salt = key_space(self.ns, t.tenant)
        first_page = t.start // self.page
        # pages may start before `start` (a partly saved page): skip the store blocks already saved
        blocks = self._reader.read_blocks(t.page_ids, self.bt)
        skip = (t.start - first_page * self.page) // self.bt
        n = (t.end - t.start) // self.bt
        blocks = blocks[skip: skip + n]
        if blocks.device.type != "cpu":
            blocks = blocks.cpu()
        hashes = block_hashes(ns, t.token_ids, t.start, t.end, salt)
        assert len(hashes) == n == blocks.shape[0], (len(hashes), n, tuple(blocks.shape))
        new = self.client.store(ns, hashes, blocks)  # one tensor: small blocks are copied in one call
        self.stats.blocks_saved += n
        self.stats.blocks_new += int(new or 0)
        self.stats.bytes_saved += blocks.numel() * blocks.element_size()


def most_of_ranks(value: int, group: Any) -> int:
    """The largest `value` over the ranks of `group` (every rank calls this at the same point of a step)."""
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(t.item())


def _run_save(save, t: Transfer, stats: WorkerStats) -> None:
    t0 = time.perf_counter()
    try:
        save(t)
    except Exception as e:  # dispatch boundary: a failed offload only costs a future miss
        if not isinstance(e, CacheNotOpen):  # (that one is logged where it is retried)
            log.exception("tierkv: save of tokens [%d, %d) failed", t.start, t.end)
        stats.errors += 1
    stats.save_s += time.perf_counter() - t0


class SaveQueue:
    """Saves run in order on one background thread, tracked per request.

    vLLM keeps a finished request's pages while `finished` has not returned
    it (the scheduler side answered True to ``request_finished`` for every
    request it planned a save for, and the worker saw each such save), and
    `wait` holds a step until the saves reading a preempted request's pages
    are done, so no page is read after vLLM reuses it.
    """

    def __init__(self, save, stats: WorkerStats) -> None:
        self._save, self.stats = save, stats
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending: dict[str, int] = {}  # req_id -> queued transfers; kept until reported finished
        self._finishing: set[str] = set()  # finished in vLLM, waiting for their saves
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, transfers: list[Transfer], skip: Iterable[str] = ()) -> None:
        skip = set(skip)
        todo = [t for t in transfers if t.req_id not in skip]
        with self._cv:
            assert not self._closed, "saves queued after close"
            for t in transfers:  # a skipped request is still reported finished: the scheduler waits for it
                self._pending.setdefault(t.req_id, 0)
            for t in todo:
                self._pending[t.req_id] += 1
        if todo:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-save", daemon=True)
                self._thread.start()
            self._queue.put(todo)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for t in batch:
                _run_save(self._save, t, self.stats)
                with self._cv:
                    self._pending[t.req_id] -= 1
                    self._cv.notify_all()

    def finished(self, req_ids: Iterable[str]) -> set[str]:
        """Of the requests vLLM finished (now or before), those whose saves are all done."""
        with self._cv:
            self._finishing.update(r for r in req_ids if r in self._pending)
            done = {r for r in self._finishing if self._pending[r] == 0}
            self._finishing -= done
            for r in done:
                del self._pending[r]
        return done

    def _busy(self, req_ids: Iterable[str] | None) -> bool:
        ids = self._pending if req_ids is None else req_ids
        return any(self._pending.get(r, 0) for r in ids)

    def wait(self, req_ids: Iterable[str] | None = None, timeout_s: float | None = None) -> bool:
        """Block until the saves of `req_ids` (default: all) are done; False on timeout."""
        ids = None if req_ids is None else list(req_ids)
        t0 = time.perf_counter()
        with self._cv:
            ok = self._cv.wait_for(lambda: not self._busy(ids), timeout_s)
        self.stats.save_wait_s += time.perf_counter() - t0
        return ok

    def waiting_requests(self) -> bool:
        """Whether a finished request still waits for its saves."""
        with self._cv:
            return bool(self._finishing)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Finish the queued saves (up to `timeout_s`), then stop the thread."""
        done = self.wait(timeout_s=timeout_s)
        with self._cv:
            self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s if done else 0.1)
        return done
