"""``kvtier plan``'s weight count for families whose layers differ from Llama's.

Expected totals are Transformers' own count of the same config (``numel`` of every
parameter of ``AutoModelForCausalLM.from_config`` on the meta device), taken once.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.plan.kvmath import estimate_params
from kvtier.plan.model import spec_from_config

_SMALL: dict[str, Any] = {
    "num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 2048, "vocab_size": 1000,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("model_type", ["apertus", "arcee", "persimmon", "nanochat",
                                        "jais2", "codegen"])
def test_an_ungated_mlp_counts_two_matrices(model_type: str) -> None:
    """Apertus (xIELU), Arcee (ReLU squared) and the others have up and down projections
    only; counted as gated, Apertus-8B came out at 8.9 B for Transformers' 7.0 B."""
    cfg = {**_SMALL, "model_type": model_type}
    spec = spec_from_config(cfg)
    assert not spec.gated_mlp
    llama = estimate_params(spec_from_config({**cfg, "model_type": "llama"}))
    assert llama.total - estimate_params(spec).total == 4 * 512 * 2048  # one matrix a layer
