"""kvtier's vLLM connector: ``kv_connector_module_path="kvtier.connectors.vllm"``,
``kv_connector="KVTierConnector"``.

The connector class is imported on first use, so the worker side (``.worker``) can be
driven without vLLM installed (GPU device checks and benchmarks).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector", "KVTierConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from .connector import KVTierConnector

        return KVTierConnector
    if name == "KVTierConnectorMetadata":
        from .metadata import KVTierConnectorMetadata

        return KVTierConnectorMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
