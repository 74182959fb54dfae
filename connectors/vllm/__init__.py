"""vLLM V1 connector: `kv_connector_module_path: "connectors.vllm"` names this
package and vLLM reads `TierKVConnector` from it. Only connector.py imports
vLLM, and only when that name is asked for: the scheduler side, the worker
side, the page layouts and the lookups are plain Python, importable (and
tested) without vLLM."""
from __future__ import annotations

from tiers.registry import lazy_exports

__all__ = ["TierKVConnector"]
__getattr__ = lazy_exports("connectors.vllm", {"TierKVConnector": "connectors.vllm.connector:TierKVConnector"})
