"""TierKVConnector plus an observer that reads vLLM's pages independently.

Loaded by vLLM through ``kv_connector_module_path="tests.connectors.vllm.kv_probe"``
in the child processes of the vLLM tests. After every load (before the
forward) and every save (after it) it records the transfer's raw pages and,
where `tests.connectors.vllm.oracle` knows vLLM's CPU packing for this ISA, the K/V of
the moved tokens decoded by plain indexing (not by our adapters), so the
tests can compare what vLLM computed, what the store holds and what loaded.
"""
from __future__ import annotations

from connectors.vllm.connector import TierKVConnector, TierKVMetadata
from tests.connectors.vllm.oracle import K_TRANSPOSED_ISAS, cpu_index, read_tokens


class ProbeTierKV(TierKVConnector):
    """Records ``{kind, start, end, first_page, pages, kv}`` for every transfer it runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []
        self.isa = self._index = None

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cfg = self._vllm_config
        self.isa = _get_attn_isa(cfg.model_config.dtype, self.page_tokens, self.ns.head_dim, "auto")
        if self.isa in K_TRANSPOSED_ISAS:
            self._index = cpu_index("k_transposed", self.page_tokens, self.ns.head_dim)
        elif self.isa == "amx":
            self._index = cpu_index("amx", self.page_tokens, self.ns.head_dim)

    def _record(self, kind: str, transfers) -> None:
        page = self.page_tokens
        layers = self.worker.kv.layers
        for t in transfers:
            end = t.end if kind == "save" else self.worker.failed.get(t.req_id, t.end)
            if end <= t.start:
                continue
            first = t.start // page * page
            pages = [layer[t.page_ids].clone() for layer in layers]
            kv = read_tokens(layers, t.page_ids, first, t.start, end, self._index) if self._index is not None \
                else None
            self.records.append({"kind": kind, "start": t.start, "end": end, "first_token": first,
                                 "pages": pages, "kv": kv})

    def start_load_kv(self, forward_context, **kwargs) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        if isinstance(meta, TierKVMetadata) and self.worker is not None:
            self._record("load", meta.loads)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, TierKVMetadata) and self.worker is not None:
            self._record("save", [t for t in meta.saves if t.req_id not in self.worker.failed])
        super().wait_for_save()
