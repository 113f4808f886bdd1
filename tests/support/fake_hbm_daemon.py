"""TEST-ONLY ``kvtier`` command whose daemon gets the fake HBM pool through ``DaemonParts``.

``python -m tests.support.fake_hbm_daemon serve --data-dir ...`` is ``kvtier serve`` with
``tests.support.fake_hbm.fake_parts()``: the production CLI, config and daemon, only the
HBM pool built by the test factory (the seam is ``kvtier.cli.main(argv, parts=...)``).
"""

from __future__ import annotations

import sys

from kvtier.cli import main
from tests.support.fake_hbm import fake_parts

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], parts=fake_parts()))
