"""``python -m kvtier.doctor``: the doctor command on its own."""

from __future__ import annotations

import sys

from kvtier.doctor.cli import main

sys.exit(main())
