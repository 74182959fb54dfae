"""tierkv as a vLLM V1 KV connector (`TierKVConnector`), tested on vLLM 0.32.0.

Start vLLM with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"url": "local:///var/cache/tierkv"}}'

``kv_connector_extra_config`` keys (anything else fails at startup):

- ``url`` (str, default ``"local://"``): the cache service, as in
  `connectors.client.connect`. ``local:///dir`` embeds a store in the vLLM
  worker's process; when the scheduler runs in another process (vLLM's
  default on CPU) it looks blocks up through the worker over a local socket.
  One vLLM instance per directory; with tensor or pipeline parallelism use
  the daemon, ``grpc://host:port`` (local:// is refused there). A service that cannot be opened
  at startup is tried again every 10 s; until then lookups miss, loads fail (vLLM recomputes)
  and saves are dropped, with a warning. A malformed URL is an error.
- ``block_tokens`` (int, default 16): tokens per store block. Keys are the engine-neutral
  hashes of docs/hash-spec.md, so with the default the blocks vLLM writes are the blocks our own
  engine writes for the same model, and vice versa. vLLM's ``block_size`` (128 on CPU, 16 on
  CUDA) must be a multiple or a divisor of it. Loaded prefixes are multiples of both.
- ``tenant`` (str, default ``""``): salts the namespace; tenants never share blocks.
  A request's ``cache_salt`` starts its blocks' hash chain from its digest: only
  requests with the same salt share them (session hints ignore salted requests).
- ``load_failure`` (``"recompute"`` | ``"fail"``, default ``"recompute"``): what vLLM does when
  a block cannot be loaded (evicted, corrupt); the connector sets vLLM's
  ``kv_load_failure_policy`` to it (a cache is best-effort: vLLM recomputes the reported blocks).
- ``async_save`` (true | false | ``"auto"``, default auto): true runs saves on a background
  thread after the step, and vLLM frees a finished request's pages once they are read
  (``get_finished``); false saves within the step, before its output is returned. Auto is true
  when vLLM's KV cache is on a GPU (the copies overlap its compute) and false on CPU, where
  background saves made each warm request 30-50 ms slower against 5 ms of saving in the step
  (vLLM's CPU worker binds its OpenMP threads to every core; torch copies from another thread
  start a second team beside them).

The namespace (`connectors.model_id.kv_namespace`) is derived from what vLLM runs: model id
(`model_id_for_dir` for a local directory, else the model name and revision), KV dtype,
attention layers, KV heads per TP rank, head dim, TP rank/world. Requests with LoRA adapters, multimodal
inputs or prompt embeddings are neither looked up nor saved (their KV depends on more than token ids).

Roles: vLLM builds one instance for the scheduler and one per worker; the scheduler side
(`connectors/vllm/scheduler.py`) plans, the worker side (`worker.py`) copies; one client per URL and process.

Layouts: the store always holds the canonical block layout of docs/hash-spec.md. vLLM's CPU
attention packs each page per ISA (K transposed for AVX-512/NEON, tiles for AMX); the worker
learns that packing at startup from vLLM's own cache writer (`learn_cpu_page_layout`), so KV
written by vLLM on one CPU is readable by our engine and by vLLM on another CPU.
"""
from __future__ import annotations

import atexit
import logging
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connectors.vllm.clients import LateClient, acquire, close_all, release
from connectors.vllm.hints import VllmSessionHints, hint_manifests
from connectors.vllm.lookup import is_local
from connectors.vllm.namespace import build_namespace
from connectors.vllm.pages import CpuPageLayout
from connectors.vllm.scheduler import SchedulerSide, TierKVConfig, Transfer, request_key, salted
from connectors.vllm.worker import WorkerSide
from tiers.types import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.tierkv")  # under vLLM's logger, so its handler shows our lines


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> workers."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # their pages are reused after this step's start
    idle: bool = False  # the step computes nothing (vLLM steps only to poll get_finished)
    step: int = 0  # this plan's number (the scheduler's plans count from 1)
    heard: int = 0  # the last step whose failed loads the scheduler had been told of when it planned this one


@dataclass
class TierKVWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler: requests whose load stopped short (req_id -> tokens loaded) in step `step`."""

    failed: dict[str, int] = field(default_factory=dict)
    step: int = 0

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "TierKVWorkerMeta":
        merged = dict(self.failed)
        for req_id, good in getattr(other, "failed", {}).items():
            merged[req_id] = min(good, merged.get(req_id, good))
        return TierKVWorkerMeta(merged, max(self.step, getattr(other, "step", 0)))


@dataclass
class TierKVStats(KVConnectorStats):
    """Counter deltas for vLLM's "KV Transfer metrics" log line."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TierKVStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


_instances: "weakref.WeakSet[TierKVConnector]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for c in list(_instances):
        c.shutdown()  # finishes its queued saves, then lets go of its client
    close_all()


def learn_cpu_page_layout(vllm_config: "VllmConfig", dtype: torch.dtype, page: int, head_dim: int
                          ) -> CpuPageLayout:
    """How vLLM's CPU attention packs one (page, head) K/V region, learned by
    writing probe tokens with vLLM's own cache writer: once with every value
    set to its token index, once to its head-dim index. The packing depends on
    the ISA vLLM picked (vec, vec16, AMX, NEON, ...), so it is read, not assumed."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = vllm_config.cache_config.cache_dtype
    if str(cache_dtype).startswith("fp8"):
        raise ConfigError("TierKVConnector does not support an fp8 KV cache on vLLM's CPU backend")
    isa = _get_attn_isa(vllm_config.model_config.dtype, page, head_dim, cache_dtype)
    if max(page, head_dim) > 256:  # probe values must be exact in bf16
        raise ConfigError(f"CPU page layout probe needs block_size and head_dim <= 256, got {page}, {head_dim}")
    region = torch.zeros(1, 1, 2 * page, head_dim, dtype=dtype)
    k_cache, v_cache = region.chunk(2, dim=2)  # the backend's own view of one page of one head
    slots = torch.arange(page, dtype=torch.int64)
    seen = []
    for probe in (torch.arange(page).view(page, 1, 1), torch.arange(head_dim).view(1, 1, head_dim)):
        values = probe.expand(page, 1, head_dim).to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(values, values, k_cache, v_cache, slots, isa)
        seen.append(region.reshape(-1).to(torch.int64))
    pos = torch.arange(2 * page * head_dim)
    index = torch.full((2, page, head_dim), -1, dtype=torch.int64)
    index[pos // (page * head_dim), seen[0], seen[1]] = pos
    layout = CpuPageLayout(index, partial(_write_tokens, isa))  # raises unless every element landed exactly once
    log.info("tierkv: vLLM CPU attention ISA %s packs pages as %s", isa, layout.kind)
    return layout


def _write_tokens(isa: str, layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM's CPU cache writer: token-major K and V into a layer's pages at token `slots`."""
    from vllm import _custom_ops as ops

    pages, heads, page, _ = layer.shape
    k_cache, v_cache = layer.view(pages, heads, 2 * page, -1).chunk(2, dim=2)  # the backend's own view
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)


def _tp() -> tuple[int, Any]:
    """This worker's TP rank and, with more than one rank, the (gloo) group its ranks agree over."""
    from vllm.distributed.parallel_state import get_tp_group

    try:
        group = get_tp_group()
    except AssertionError:  # no TP group: a single worker
        return 0, None
    return group.rank_in_group, (group.cpu_group if group.world_size > 1 else None)


def _request_tenant(request: "Request", tenant: str) -> str | None:
    """The key of a request's blocks (scheduler.request_key), or None when its KV is not a function of
    token ids alone."""
    if request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
        return None
    return request_key(tenant, getattr(request, "cache_salt", None))


def _hinted(request: "Request", key: str) -> bool:
    """Whether to act on a request's session hints: sessions keep unsalted chains (a salted request's are its own)."""
    return bool(request.kv_transfer_params) and not salted(key)


def _instance(vllm_config: "VllmConfig", url: str) -> str:
    """This engine's identity, the same in its scheduler and worker processes
    (each data-parallel rank is an engine of its own); refuses an embedded
    store shared by several workers, which only one process can open."""
    par = vllm_config.parallel_config
    if is_local(url) and par.tensor_parallel_size * par.pipeline_parallel_size > 1:
        raise ConfigError("kv_connector_extra_config.url: an embedded store (local://) is opened by one process; "
                          "with tensor or pipeline parallelism use the daemon (tierkv serve, grpc://host:port)")
    return f"{vllm_config.instance_id}/dp{par.data_parallel_rank}"


class TierKVConnector(KVConnectorBase_V1):
    """tierkv's vLLM V1 KV connector (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = TierKVConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        is_worker = role == KVConnectorRole.WORKER
        rank, ranks = _tp() if is_worker else (0, None)
        self.ns, self.page_tokens = build_namespace(vllm_config, kv_cache_config, self.cfg, rank)
        self.client = acquire(self.cfg.url, worker=is_worker, instance=_instance(vllm_config, self.cfg.url))
        auto = vllm_config.device_config.device_type != "cpu"
        self.async_save = self.cfg.async_save if isinstance(self.cfg.async_save, bool) else auto
        self._closed = False
        self._reported: dict[str, float] = {}
        self.scheduler: SchedulerSide | None = None
        self.hints: VllmSessionHints | None = None
        self.worker: WorkerSide | None = None
        _instances.add(self)
        if self.client is None:
            return
        if is_worker:
            self.worker = WorkerSide(self.client, self.ns, self.page_tokens, self.async_save, ranks)
        else:
            # vLLM reads the policy after building the scheduler's connector
            self._kv_transfer_config.kv_load_failure_policy = self.cfg.load_failure
            self.scheduler = SchedulerSide(self.client, self.ns, self.page_tokens)
            # a cache not open yet cannot lend its directory: the manifests open one of their own
            manifests = hint_manifests(self.cfg.url, self.cfg.config,
                                       None if isinstance(self.client, LateClient) else self.client)
            self.hints = VllmSessionHints(self.client, self.scheduler.namespace, manifests, self.cfg.tenant)
        log.info("tierkv: %s connector on %s, namespace %s (%s)", role.name.lower(), self.cfg.url,
                 self.ns.fingerprint().hex(), self.ns.model_id)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never lost output

    # ================================================================ worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is None:
            return
        first = next(iter(kv_caches.values()))
        layout = None
        if first.device.type == "cpu" and first.dim() == 4:
            layout = learn_cpu_page_layout(self._vllm_config, first.dtype, self.page_tokens, self.ns.head_dim)
        # a step saves at most what it computed (plus the page it started in)
        step_tokens = self._vllm_config.scheduler_config.max_num_batched_tokens + self.page_tokens
        self.worker.register(kv_caches, layout, reserve_tokens=step_tokens)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, TierKVMetadata) and meta.loads:
            self.worker.load(meta.loads, meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves copy every layer at once in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, TierKVMetadata) and meta.saves:
            self.worker.save(meta.saves, meta.heard)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        saves = self.worker.saves if self.worker is not None else None
        meta = kv_connector_metadata
        if saves is not None and isinstance(meta, TierKVMetadata) and meta.preempted:
            saves.wait(meta.preempted)  # vLLM reuses their pages in this step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        saves = self.worker.saves if self.worker is not None else None
        if saves is None:
            return None, None
        meta = self._connector_metadata
        if isinstance(meta, TierKVMetadata) and meta.idle and saves.waiting_requests():
            # vLLM steps without work only to ask us: wait a little here instead of spinning
            saves.wait(timeout_s=0.05)
        return saves.finished(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid_pages() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> TierKVWorkerMeta | None:
        if self.worker is None:
            return None
        failed = self.worker.take_failed()
        return TierKVWorkerMeta(failed, self.worker.failed_step) if failed else None

    def get_kv_connector_stats(self) -> TierKVStats | None:
        side = self.worker or self.scheduler
        if side is None:
            return None
        now = _as_dict(side.stats)
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return TierKVStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierKVStats:
        return TierKVStats(data=dict(data or {}))

    # ============================================================= scheduler
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:  # dispatch boundary: an error here would stop vLLM's engine for every request; nothing is promised yet
            tenant = _request_tenant(request, self.cfg.tenant)
            if self.scheduler is None or tenant is None:
                return 0, False
            if _hinted(request, tenant) and not self.scheduler.knows(request.request_id):  # first sight: a
                self.hints.arrived(request.kv_transfer_params, tenant)  # prefetch starts before the lookup
            n = self.scheduler.matched_tokens(request.request_id, request.all_token_ids, num_computed_tokens, tenant)
        except Exception:
            log.exception("tierkv: lookup of request %s failed; computing it", request.request_id)
            return 0, False
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.scheduler is not None and num_external_tokens > 0:
            self.scheduler.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> TierKVMetadata:
        if self.scheduler is None:
            return TierKVMetadata()
        scheduled = [(r.req_id, r.num_computed_tokens, scheduler_output.num_scheduled_tokens[r.req_id])
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [(req_id, computed, scheduler_output.num_scheduled_tokens[req_id])
                      for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens)]
        state = scheduler_output.kv_connector_block_state
        assert state is not None, "vLLM >= 0.32 hands the connector the block state of scheduled requests"
        loads, saves = self.scheduler.plan(scheduled, lambda req_id: state.get_block_ids(req_id)[0])
        return TierKVMetadata(loads, saves, sorted(scheduler_output.preempted_req_ids or ()),
                              idle=scheduler_output.total_num_scheduled_tokens == 0,
                              step=self.scheduler.step, heard=self.scheduler.heard)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.scheduler is not None and isinstance(meta, TierKVWorkerMeta):
            for req_id, good in meta.failed.items():
                log.warning("tierkv: request %s loaded only %d tokens; vLLM recomputes the rest", req_id, good)
                self.scheduler.load_failed(req_id, good, meta.step)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        saving = self.scheduler.finished(request.request_id)
        tenant = _request_tenant(request, self.cfg.tenant)
        if tenant is not None and _hinted(request, tenant):
            self.hints.finished(request.kv_transfer_params, tenant,
                                request.all_token_ids[:request.num_computed_tokens])
        return saving and self.async_save, None  # True: vLLM frees the pages once get_finished says so

    # ================================================================ both
    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            if self.hints is not None:
                self.hints.close()
            if self.worker is not None and self.worker.saves is not None:
                if not self.worker.saves.close():
                    log.warning("tierkv: saves still running at shutdown were abandoned")
            release(self.cfg.url)


def connectors_in_process() -> list[TierKVConnector]:
    """The live TierKVConnector instances of this process (scheduler and/or
    workers), for stats and debugging."""
    return list(_instances)


def _as_dict(stats: Any) -> dict[str, float]:
    return {f: getattr(stats, f) for f in stats.__slots__}
