"""End to end with an embedding model vLLM supports no prefix caching for: a tiny Llama
served with MEAN pooling, which pools over every prompt token in one prefill. With a
loaded prefix its pooler raised "partial prefill is not supported with MEAN pooling" and
the engine core died (found by review); the connector now follows vLLM and never loads
for it, while it still saves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.e2e.conftest import EngineRun
from tests.e2e.vllm_engine import (
    add_tiny_tokenizer,
    build_tiny_llama,
    kv_transfer_config,
    prompt,
)
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

PROMPTS = [prompt(61, 200), prompt(62, 277)]


@pytest.fixture(scope="module")
def pool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a tokenizer (a pooling engine loads one)."""
    return add_tiny_tokenizer(build_tiny_llama(tmp_path_factory.mktemp("tiny-pool")))


def test_a_mean_pooling_engine_embeds_the_same_prompts_again(
        run_engine: EngineRun, daemon: DaemonProcess, pool_model: Path) -> None:
    """The second embedding of each prompt finds its blocks in kvtier (the first saved
    them) and must neither load them nor fail: the same vector, nothing cached."""
    transfer = kv_transfer_config(daemon.socket, model_id="tiny-pool")
    first, again = run_engine([{"prompts": PROMPTS, "embed": True},
                               {"prompts": PROMPTS, "embed": True}], transfer=transfer,
                              model=pool_model, engine_args={
                                  "runner": "pooling", "skip_tokenizer_init": False,
                                  "pooler_config": {"seq_pooling_type": "MEAN"}})
    for (vec1, cached1), (vec2, cached2) in zip(first, again, strict=True):
        assert len(vec1) == 64 and np.allclose(vec1, vec2, rtol=1e-5, atol=1e-6)
        assert cached1 == cached2 == 0
    assert daemon.stats()["tiers"]["cpu"]["blocks"] >= sum(len(p) // 64 for p in PROMPTS)
