"""kvtier: a tiered KV-cache offload service for LLM serving engines.

The core package imports neither torch nor cupy; GPU and engine integrations live in
``kvtier.kernels`` and ``kvtier.connectors`` and are imported only where used.
"""

__version__ = "0.1.0"
