"""Mutation-review pins for per-layer KV shapes (Gemma-4, Step-3.5), DeciLM block stacks,
hybrid layer patterns, the DeepSeek-V3.2 indexer and Transformers' class defaults: the
numbers an operator sizes a node with."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.shapes import layer_shapes

SRC = "config.json"
_G4 = ["sliding_attention", "full_attention", "sliding_attention"]


def test_gemma4_global_kv_heads_need_attention_k_eq_v() -> None:
    """num_global_key_value_heads applies only with attention_k_eq_v: by default the full
    layers keep the model's KV heads (only their head size grows)."""
    cfg: dict[str, Any] = {"model_type": "gemma4_text", "layer_types": _G4,
                           "num_global_key_value_heads": 1, "global_head_dim": 512}
    assert layer_shapes(cfg, 3, (4, 256), SRC) == ((4, 256), (4, 512), (4, 256))
    cfg["attention_k_eq_v"] = True
    assert layer_shapes(cfg, 3, (4, 256), SRC) == ((4, 256), (1, 512), (4, 256))


def test_gemma4_per_layer_config_sets_heads_and_refuses_a_layer_past_the_end() -> None:
    """An explicit per_layer_config wins for KV heads and head size; a key naming a layer
    past the stack is a typed error, not an IndexError."""
    cfg: dict[str, Any] = {"model_type": "gemma4_text", "layer_types": _G4,
                           "per_layer_config": {"1": {"num_key_value_heads": 2}}}
    assert layer_shapes(cfg, 3, (4, 256), SRC) == ((4, 256), (2, 256), (4, 256))
    cfg["per_layer_config"] = {"3": {"head_dim": 128}}
    with pytest.raises(PlanError, match="per_layer_config"):
        layer_shapes(cfg, 3, (4, 256), SRC)


def test_step3p5_other_setting_goes_to_its_type_only() -> None:
    """Three sliding layers take attention_other_setting, the one full layer does not
    (an asymmetric stack: swapping them changes the KV)."""
    cfg = {"model_type": "step3p5",
           "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
           "attention_other_setting": {"attention_type": "sliding_attention",
                                       "num_attention_groups": 16, "head_dim": 64}}
    assert layer_shapes(cfg, 4, (8, 128), SRC) == ((8, 128),) + ((16, 64),) * 3


def test_block_configs_must_list_every_layer() -> None:
    """block_configs shorter than num_hidden_layers is refused: read as given, the missing
    layers' KV went unplanned."""
    from kvtier.plan.blocks import read_blocks

    block = {"attention": {"n_heads_in_group": 8}, "ffn": {"intermediate_size": 1024}}
    with pytest.raises(PlanError, match="one block per layer"):
        read_blocks({"block_configs": [block] * 3}, 4, 64, 8192, SRC)
    stack = read_blocks({"block_configs": [block] * 4}, 4, 64, 8192, SRC)
    assert stack is not None and stack.kv_heads == 8 and len(stack.blocks) == 4
    assert stack.blocks[0].ffn_width == 1024   # intermediate_size wins over ffn_mult


def test_block_ffn_mult_must_be_above_zero() -> None:
    """ffn_mult 0 is refused, not an MLP of width 0 (weights undercounted)."""
    from kvtier.plan.blocks import read_blocks

    block = {"attention": {"n_heads_in_group": 8}, "ffn": {"ffn_mult": 0}}
    with pytest.raises(PlanError, match="ffn_mult"):
        read_blocks({"block_configs": [block]}, 1, 64, 8192, SRC)


def test_canonical_field_wins_over_its_older_spelling_and_zero_means_unset() -> None:
    """With num_hidden_layers and n_layer both set the canonical one is read; an optional
    field of 0 takes its default (decoder_sparse_step 0 is every layer MoE, not a
    division by zero)."""
    from kvtier.plan.fields import key_of, opt_int
    from kvtier.plan.moe import moe_layer_mask

    assert key_of({"num_hidden_layers": 4, "n_layer": 8}, "num_hidden_layers") \
        == "num_hidden_layers"
    assert key_of({"n_layer": 8}, "num_hidden_layers") == "n_layer"
    assert opt_int({"x": 0}, "x", SRC, 7) == 7
    assert moe_layer_mask({"decoder_sparse_step": 0}, 3, SRC) == (True, True, True)


def test_bailing_trailing_layers_are_mla_only_for_v3() -> None:
    """Layers past the last whole group are MLA only in Bailing-V3; a config naming no
    architecture is V2.5 (linear attention there), not V3."""
    from kvtier.plan.hybrid import FULL, STATE, hybrid_types

    cfg: dict[str, Any] = {"model_type": "bailing_hybrid", "layer_group_size": 4}
    assert hybrid_types(cfg, 6) == [STATE, STATE, STATE, FULL, STATE, STATE]
    cfg["architectures"] = ["BailingMoeV3ForCausalLM", "Other"]
    assert hybrid_types(cfg, 6) == [STATE, STATE, STATE, FULL, FULL, FULL]
    cfg["layer_group_size"] = 0   # unusable: groups of one (every layer MLA), no crash
    assert hybrid_types(cfg, 2) == [FULL, FULL]


def test_indexer_layers_edges() -> None:
    """vLLM builds the indexer whenever the config has index_topk (hasattr: null too); a
    short index_topk_pattern leaves the layers past it indexed (no IndexError); an absurd
    negative offset is a typed error."""
    from kvtier.plan.indexer import indexer_layers

    assert indexer_layers({"index_topk": None}, 2, SRC) == (True, True)
    assert indexer_layers({"index_topk": 2048, "index_topk_pattern": "S"}, 3, SRC) \
        == (False, True, True)
    with pytest.raises(PlanError, match="index_skip_topk_offset"):
        indexer_layers({"index_topk": 2048, "index_skip_topk_offset": -5000}, 3, SRC)


@pytest.mark.parametrize(("model_type", "field", "value"), [
    ("gemma2", "num_key_value_heads", 4),
    ("gemma3_text", "sliding_window", 4096),
    ("gemma3n_text", "num_key_value_heads", 2),
    ("gemma4_unified_text", "sliding_window", 1024),
    ("qwen3_next", "head_dim", 256),
    ("mimo_v2_flash", "head_dim", 192),
])
def test_class_defaults_match_transformers(model_type: str, field: str, value: int) -> None:
    """The defaults of Transformers' config classes (checked against 5.19): a config that
    omits the field is served with these, and each one scales the planned KV."""
    from kvtier.plan.defaults import with_class_defaults

    assert with_class_defaults({"model_type": model_type})[field] == value
    assert with_class_defaults({"model_type": model_type, field: 7})[field] == 7


def test_llama4_text_config_without_a_type_takes_llama4_text_defaults() -> None:
    """A Llama-4 text_config with no model_type is llama4_text: head_dim 128 by class
    default, not hidden / heads (102 here, a fifth less KV)."""
    from kvtier.plan.model import spec_from_config

    text = {"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 40,
            "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 1000}
    assert spec_from_config({"model_type": "llama4", "text_config": text}).head_dim == 128
