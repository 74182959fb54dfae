"""vLLM V1 connector: `kv_connector_module_path: "connectors.vllm"` names this package."""
from connectors.vllm.connector import TierKVConnector

__all__ = ["TierKVConnector"]
