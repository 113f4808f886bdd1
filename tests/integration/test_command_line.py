"""The ``kvtier`` command line in a subprocess, as a user runs it: ``doctor`` and ``plan``.
(Moved from the unit tests: these start processes.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.doctor.rules import Pattern
from tests.support.doctor_scenarios import scenario_argv


def test_kvtier_command_line_runs_doctor_in_a_subprocess() -> None:
    pytest.importorskip("kvtier.cli")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from kvtier.cli import main; sys.exit(main())",
         "doctor", *scenario_argv("long_prompts"), "--json"],
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert [f["pattern"] for f in json.loads(proc.stdout)["findings"]] == [
        Pattern.LONG_PROMPTS_KV_FULL.value]


def test_kvtier_command_line_runs_plan_in_a_subprocess() -> None:
    pytest.importorskip("kvtier.cli")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from kvtier.cli import main; sys.exit(main())",
         "plan", "--model", "llama-2-13b", "--kv-dtype", "fp16", "--json"],
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_bytes_per_token"] == 819_200


@pytest.mark.parametrize("argv", [["plan", "--model", "llama-3-8b", "--json"],
                                  ["doctor", *scenario_argv("long_prompts"), "--json"]],
                         ids=["plan", "doctor"])
def test_a_reader_that_goes_away_gets_no_traceback(argv: list[str]) -> None:
    """`kvtier plan --json | head` ended in a BrokenPipeError traceback: the output goes
    to a pipe whose reader is gone; the command exits 1, quietly."""
    code = ("import os, sys\n"
            "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
            "from kvtier.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                          text=True, timeout=60, check=False)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 1
