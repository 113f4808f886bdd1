"""``kvtier plan``: KV-cache capacity planning from a model config and a workload."""

from __future__ import annotations

from kvtier.plan.cli import add_parser, run
from kvtier.plan.errors import PlanError

__all__ = ["PlanError", "add_parser", "run"]
