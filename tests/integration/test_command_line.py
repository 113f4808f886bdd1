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


@pytest.mark.parametrize(("argv", "needle"), [
    (["replay", "/dev/zero"], "is a device or a socket, not a file"),
    (["replay", "-"], "line longer than"),   # standard input as it comes, lines bounded
    (["plan", "--model", "llama-2-7b", "--trace", "/dev/zero"],
     "is a device or a socket, not a file"),
    (["plan", "--model", "llama-2-7b", "--live-stats", "/dev/zero"], "not a regular file"),
])
def test_a_device_is_refused_in_one_line(argv: list[str], needle: str) -> None:
    """``kvtier replay /dev/zero`` (or ``- < /dev/zero``, or plan --trace, or plan
    --live-stats) read until memory ran out; a device is refused before a byte is read
    (memory capped at 2 GiB here so that the old behaviour fails the test instead of the
    machine)."""
    import resource
    import subprocess

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    with open("/dev/zero", "rb") as zero:
        p = subprocess.run([sys.executable, "-m", "kvtier.cli", *argv], stdin=zero,
                           capture_output=True, text=True, timeout=60, preexec_fn=cap)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert needle in p.stderr and any(w in p.stderr for w in ("/dev/zero", "<stdin>"))
