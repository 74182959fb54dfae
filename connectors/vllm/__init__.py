"""vLLM V1 connector: `kv_connector_module_path: "connectors.vllm"` names this
package and vLLM reads `TierKVConnector` from it. Only connector.py imports
vLLM, and only when that name is asked for: the scheduler side, the worker
side, the page layouts and the lookups are plain Python, importable (and
tested) without vLLM."""
from __future__ import annotations

from typing import Any

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        from connectors.vllm.connector import TierKVConnector

        return TierKVConnector
    raise AttributeError(f"module 'connectors.vllm' has no attribute {name!r}")
