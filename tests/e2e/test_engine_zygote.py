"""The e2e tests' engine zygote (``engine_zygote.py``) runs a script as ``python SCRIPT``
would: its exit code, its output in the log, its environment; a run that ends at once
(both replies in one read) is told as fast as a slow one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Zygote

pytestmark = pytest.mark.e2e


def test_a_script_runs_as_main_with_its_env_argv_and_exit_code(
        zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "print('argv', sys.argv[1:], 'env', os.environ.get('ZYGOTE_PROBE'), 'name', __name__)\n"
        "open(sys.argv[1], 'w').write('done')\n"
        "sys.exit(int(sys.argv[2]))\n")
    out, log = tmp_path / "out", tmp_path / "log"
    env = {**os.environ, "ZYGOTE_PROBE": "seen"}
    zygote.check([str(script), str(out), "0"], log, env, out)
    assert f"argv ['{out}', '0'] env seen name __main__" in log.read_text()
    t0 = time.monotonic()
    assert zygote.run([str(script), str(out), "3"], log, {**os.environ}) == 3
    assert "env None" in log.read_text()     # the previous run's environment is not kept
    assert time.monotonic() - t0 < 30


def test_a_script_that_raises_exits_1_with_its_traceback(zygote: Zygote,
                                                         tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('boom in the engine')\n")
    log = tmp_path / "log"
    assert zygote.run([str(script)], log, dict(os.environ)) == 1
    assert "RuntimeError: boom in the engine" in log.read_text()
