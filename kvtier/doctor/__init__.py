"""``kvtier doctor``: diagnose KV memory pressure from engine and kvtier metrics."""

from __future__ import annotations

from kvtier.doctor.cli import add_parser, run
from kvtier.doctor.errors import DoctorError

__all__ = ["DoctorError", "add_parser", "run"]
