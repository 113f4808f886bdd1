"""TEST-ONLY interpreter hook: with KVTIER_TEST_FAKE_HBM=1, the kvtier daemon started in this
interpreter gets a host-memory fake HBM pool (tests/support/fake_hbm.py). This directory is
put on PYTHONPATH only by tests (``fake_hbm.daemon_env()``); kvtier itself never reads the
variable."""

import os

if os.environ.get("KVTIER_TEST_FAKE_HBM") == "1":
    from tests.support.fake_hbm import install_daemon_fake

    install_daemon_fake()
