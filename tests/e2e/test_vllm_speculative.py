"""End to end with EAGLE3 speculative decoding in vLLM's multiprocess mode (its default):
the scheduler side and the workers each name the engine's namespace in their own process.
vLLM gives every draft model a callable ``hf_overrides`` of its own, and loading the draft
changes the workers' copy of its config; a fingerprint that read that config split the
engine in two (saves under one name, lookups under another: nothing ever hit; found by
review). The second pass over the same prompts must hit, with the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import EngineRun
from tests.e2e.vllm_engine import (
    TOKENS_PER_BLOCK,
    build_tiny_eagle3,
    build_tiny_llama,
    kv_transfer_config,
    prompt,
)
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

PROMPTS = [prompt(71, 300), prompt(72, 200)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 6-layer tiny Llama and an EAGLE3 draft for it."""
    return (build_tiny_llama(tmp_path_factory.mktemp("tiny-six"), layers=6),
            build_tiny_eagle3(tmp_path_factory.mktemp("tiny-eagle3")))


def test_an_eagle3_engine_in_multiprocess_mode_hits_its_own_kv(
        run_engine: EngineRun, daemon: DaemonProcess, models: tuple[Path, Path]) -> None:
    target, draft = models
    transfer = kv_transfer_config(daemon.socket, model_id="tiny-eagle3")
    first, again = run_engine(
        [{"prompts": PROMPTS}, {"prompts": PROMPTS}], transfer=transfer, multiprocess=True,
        model=target, engine_args={"max_model_len": 1024, "speculative_config": {
            "method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}})
    for p, (tokens1, cached1), (tokens2, cached2) in zip(PROMPTS, first, again, strict=True):
        assert tokens2 == tokens1 and cached1 == 0
        # every whole kvtier block but the last token's comes from kvtier
        assert cached2 == (len(p) - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK, (len(p), cached2)
