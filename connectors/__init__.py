"""tierkv's engine side: what an inference engine links to reach the cache.

The front door. Names are imported on first use (``import connectors``
imports neither gRPC nor vLLM):

    from connectors import connect, EngineConnector, kv_namespace

    client = connect("grpc://127.0.0.1:7600")   # or "local:///dir", or "none" (None)
    ns = kv_namespace(model_dir, "bfloat16", num_layers, num_kv_heads, head_dim, block_tokens=16)
    connector = EngineConnector(client, ns, page_size=16)

`connect(url)` gives a `CacheClient`: the embedded store for ``local://``,
`connectors.grpc.client.GrpcClient` for ``grpc://`` (the daemon; on the
same host through shared memory, across hosts through its TCP data path).
`EngineConnector` is our engine's connector; vLLM's is
``kv_connector_module_path: "connectors.vllm"`` (connectors/vllm/).
docs/architecture.md follows a load from each of them to a tier.
"""
from __future__ import annotations

from tiers.registry import lazy_exports

_EXPORTS = {
    "connect": "connectors.client:connect",
    "CacheClient": "connectors.client:CacheClient",
    "EngineConnector": "connectors.engine:EngineConnector",
    "kv_namespace": "connectors.model_id:kv_namespace",
    "model_id_for_dir": "connectors.model_id:model_id_for_dir",
    "GrpcClient": "connectors.grpc.client:GrpcClient",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("connectors", _EXPORTS)
