"""End to end: two engine processes share one daemon; the second hits what the first saved.

The second engine runs in vLLM's default multiprocess mode (engine core in its own
process) and loads asynchronously (``async_load``: vLLM's WAITING_FOR_REMOTE_KVS path);
the first, which only saves, runs its engine core inside its own process (vLLM's
in-process mode: one spawned engine core, ~10-20 s here, is enough to cover that mode).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import PROMPTS, EngineRun
from tests.e2e.vllm_engine import TOKENS_PER_BLOCK, kv_transfer_config
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd-shared"), cpu_bytes="64MiB",
                       nvme_bytes="0") as d:
        yield d


def test_second_engine_process_hits_first_engines_prefix(
        run_engine: EngineRun, daemon: DaemonProcess, baseline: dict[str, list[int]]) -> None:
    prompt = PROMPTS["two_engines"]
    expected = baseline["two_engines"]
    hit = len(prompt) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
    (first,) = run_engine([{"prompts": [prompt]}], kv_transfer_config(daemon.socket))
    assert first == [(expected, 0)]
    (second,) = run_engine([{"prompts": [prompt]}],
                           kv_transfer_config(daemon.socket, async_load=True),
                           multiprocess=True)
    assert second == [(expected, hit)]
    assert daemon.stats()["requests"]["get_blocks"] >= hit // TOKENS_PER_BLOCK
