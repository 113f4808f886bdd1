"""A kvtier load that fails with vLLM's own prefix cache on: the pages that failed stay in
vLLM's cache under ``kv_load_failure_policy="recompute"`` (kept for the request vLLM rolls
back to rewrite them), so when that request is aborted or preempted first, or another
request shares them before they are rewritten, a later hit on them decoded on zeroed KV
and gave wrong tokens (found by review). The connector reports the bad pages a request
counts computed as that step's load errors, and vLLM rolls that request back too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, Zygote
from tests.e2e.vllm_engine import ENGINE_ENV
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

RUNNER = Path(__file__).with_name("failed_load_engine.py")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async-scheduling"])
@pytest.mark.parametrize("scenario", ["abort", "duplicate", "preempt"])
def test_pages_that_failed_to_load_are_never_a_later_hit(
        scenario: str, asynchronous: bool, tiny_model: Path, tmp_path: Path,
        zygote: Zygote) -> None:
    """Under vLLM's async scheduling (its GPU default) a rollback vLLM did not start
    itself crashed the engine (it had scheduled the next step on the request's sampled
    token), so the connector loads in the background there: vLLM caches nothing that
    failed to load in the background (found by review)."""
    out = tmp_path / "out.json"
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO),
           "ASYNC_SCHEDULING": "1" if asynchronous else "0"}
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="64MiB", nvme_bytes="0") as d:
        zygote.check([str(RUNNER), scenario, str(tiny_model), str(d.socket), str(out)],
                     tmp_path / "engine.log", env, out)
    result = json.loads(out.read_text())
    want, got = result["want"], result["got"]
    assert got, result
    for name, (tokens, cached) in got.items():
        assert tokens == want[name], (name, cached)
    if scenario != "preempt" and not asynchronous:
        # a later request reused the prompt's pages in vLLM's cache (synchronous loads
        # leave them there; background loads are cached only once they succeeded)
        assert max(cached for _, cached in got.values()) > 256


def test_an_idle_in_process_engine_can_reset_its_cache_after_generate(
        tiny_model: Path, tmp_path: Path, zygote: Zygote) -> None:
    """A request with saves was freed only when a later step reported them over; an idle
    in-process engine runs none, and vLLM's cache reset (sleep, a weight update) failed on
    the pages still held (found by review). A request whose saves every worker has
    acknowledged is freed at once."""
    out = tmp_path / "out.json"
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="64MiB", nvme_bytes="0") as d:
        zygote.check([str(Path(__file__).with_name("idle_reset_engine.py")),
                      str(tiny_model), str(d.socket), str(out)], tmp_path / "engine.log",
                     {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO)}, out)
        saved = d.stats()["tiers"]["cpu"]["blocks"]
    result = json.loads(out.read_text())
    assert result["ok"], result["error"]
    assert saved >= 4   # the prompts were saved (300 and 200 tokens, 64-token blocks)
