"""The planner's typed error."""

from __future__ import annotations

from kvtier.errors import KVTierError


class PlanError(KVTierError, ValueError):
    """A model config, preset, workload or trace given to ``kvtier plan`` is unusable.

    The message names the input that was wrong and what to pass instead.
    """

    code = "plan"
