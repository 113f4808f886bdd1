"""kvtier's vLLM connector: ``kv_connector_module_path="kvtier.connectors.vllm"``,
``kv_connector="KVTierConnector"``."""

from __future__ import annotations

from .connector import KVTierConnector
from .metadata import KVTierConnectorMetadata

__all__ = ["KVTierConnector", "KVTierConnectorMetadata"]
