"""Stand-ins for vLLM's objects in tests that drive the connector's sides directly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def fake(**fields: Any) -> Any:
    """An object with only ``fields``, standing in for one of vLLM's (a request, its
    ``KVCacheBlocks``, a ``SchedulerOutput``, a ``KVConnectorOutput``, a cache set): the
    connector reads those attributes alone. Typed ``Any``, as the duck type it is."""
    return SimpleNamespace(**fields)
