"""Paths tests read, relative to the repository root (never absolute).

The shared folder (traces too large for the repository) sits next to the checkout:
``../shared`` from the repository root. ``KVTIER_TEST_SHARED_DIR`` points elsewhere, e.g. for
a git worktree that is not a sibling of it; tests that need a file from it skip when absent.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVTIER_TEST_SHARED_DIR") or REPO.parent / "shared")
MOONCAKE_TRACE = SHARED / "traces" / "mooncake_synthetic_trace.jsonl"
"""The shared Mooncake-format trace (``../shared/traces/`` from the repository root)."""
