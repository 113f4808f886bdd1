"""End to end with tensor parallelism (CPU engine, TP 2, vLLM's multiprocess executor): one
rank's load fails while the other's succeeds.

What rank 0 computes in that step depends on rank 1's shard through the all-reduce after
attention, so both ranks must cut their saves where rank 1's load failed. Rank 0 once
saved its shard anyway: after the recompute rank 1 saved its own, the block looked
complete on both ranks, and a fresh engine loaded rank 0's wrong shard and generated wrong
tokens (kvtier.connectors.vllm.ranks).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import EngineRun
from tests.e2e.vllm_engine import TOKENS_PER_BLOCK, kv_transfer_config, prompt
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "max_model_len": 1024}
PREFIX = prompt(40, 3 * TOKENS_PER_BLOCK + 11)
PROMPT = PREFIX + prompt(41, 150)     # loads 3 blocks, computes blocks 3 and 4 in that step


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd-tp"), cpu_bytes="64MiB") as d:
        yield d


def test_a_load_that_fails_on_one_rank_leaves_no_wrong_shard(
        run_engine: EngineRun, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    cfg = kv_transfer_config(daemon.socket, model_id="tp-one-rank")
    # one engine, four phases (vLLM's own prefix cache is off: each phase's prompt is
    # looked up in kvtier, and a lookup waits for the saves of the blocks it asks for). The
    # first computes the prompt from nothing under a salt of its own: the baseline, without
    # a second TP 2 engine start (~30 s)
    ((baseline, computed),), _, ((failed, tried),), ((again, cached),) = run_engine(
        [{"prompts": [PROMPT], "salts": ["baseline"]},
         {"prompts": [PREFIX + prompt(42, 30)], "max_tokens": 2},
         {"prompts": [PROMPT], "lose_blocks_at_load": {"blocks": [1, 3], "rank": 1}},
         {"prompts": [PROMPT]}], cfg, engine_args=TP2)
    assert computed == 0
    assert tried == 3 * TOKENS_PER_BLOCK   # the load of the prefix was tried (and failed)
    assert failed == baseline
    assert again == baseline
    assert cached == 5 * TOKENS_PER_BLOCK  # it loaded what kvtier holds, the recompute too
