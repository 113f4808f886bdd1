"""``python -m kvtier.plan``: the plan command on its own."""

from __future__ import annotations

import sys

from kvtier.plan.cli import main

sys.exit(main())
