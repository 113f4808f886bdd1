"""``kvtier plan``'s MoE parameter count: which layers are MoE, and shared experts.

Expected totals are Transformers' own count of the same config (``numel`` of every
parameter of ``AutoModelForCausalLM.from_config`` on the meta device).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.kvmath import estimate_params
from kvtier.plan.model import spec_from_config
from tests.unit.test_plan_cli import plan_json

_LLAMA4: dict[str, Any] = {
    "model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_experts_per_tok": 1,
    "vocab_size": 202048, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# Llama-4-Maverick-17B-128E: MoE on every 2nd layer, dense MLP of intermediate_size_mlp on
# the others, one shared expert of intermediate_size in each MoE layer.
MAVERICK = {**_LLAMA4, "num_local_experts": 128, "interleave_moe_layer_step": 2}
SCOUT = {**_LLAMA4, "num_local_experts": 16, "interleave_moe_layer_step": 1}
# Qwen1.5-MoE-A2.7B: 60 routed experts of 1408 and one shared expert of 5632.
QWEN15_MOE = {
    "model_type": "qwen2_moe", "num_hidden_layers": 24, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
    "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
}


def test_llama4_maverick_counts_dense_layers_and_the_shared_expert() -> None:
    counted = estimate_params(spec_from_config(MAVERICK))
    assert counted.total == 400_711_848_960  # Transformers: 400.7 B, not 778 B
    assert counted.active / 1e9 == pytest.approx(17, rel=0.02)  # "17B active"
    listed = {**MAVERICK, "moe_layers": list(range(1, 48, 2))}
    assert estimate_params(spec_from_config(listed)) == counted
    assert spec_from_config(MAVERICK).moe is not None
    assert spec_from_config(MAVERICK).moe.dense_layers == 24  # type: ignore[union-attr]


def test_llama4_scout_keeps_its_implicit_shared_expert() -> None:
    counted = estimate_params(spec_from_config(SCOUT))
    assert counted.total == 107_769_861_120
    shared = 48 * 3 * 5120 * 8192
    routed_active = 48 * 3 * 5120 * 8192  # one routed expert per token
    assert counted.active - (counted.total - counted.experts) == shared + routed_active


def test_qwen_moe_counts_its_shared_expert() -> None:
    counted = estimate_params(spec_from_config(QWEN15_MOE))
    # Transformers: 14,315,784,192; the rest is the shared expert's gate and the QKV bias.
    assert counted.total == pytest.approx(14_315_784_192, rel=1e-4)
    assert counted.active / 1e9 == pytest.approx(2.7, rel=0.02)  # "A2.7B"
    shared = 24 * 3 * 2048 * 5632
    assert counted.experts == 24 * 60 * 3 * 2048 * 1408 + shared


@pytest.mark.parametrize("extra", [{"n_shared_experts": 2}, {"num_shared_experts": 2},
                                   {"moe_num_shared_experts": 2}])
def test_a_count_of_shared_experts_is_expert_wide(extra: dict[str, Any]) -> None:
    cfg = {k: v for k, v in QWEN15_MOE.items() if k != "shared_expert_intermediate_size"}
    counted = estimate_params(spec_from_config({**cfg, **extra}))
    assert counted.experts == 24 * (60 + 2) * 3 * 2048 * 1408


def test_sparse_step_and_mlp_only_layers_leave_dense_layers() -> None:
    cfg = {**QWEN15_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1]}
    moe = spec_from_config(cfg).moe
    assert moe is not None
    assert [i for i, sparse in enumerate(moe.moe_layers) if sparse] == list(range(3, 24, 2))
    typed = {**QWEN15_MOE, "mlp_layer_types": ["dense"] * 4 + ["sparse"] * 20}
    assert spec_from_config(typed).moe.dense_layers == 4  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [{"moe_layers": [1, 99]}, {"mlp_only_layers": "all"},
                                 {"mlp_layer_types": ["dense"]}])
def test_malformed_moe_layer_fields_name_the_field(bad: dict[str, Any]) -> None:
    with pytest.raises(PlanError, match=next(iter(bad))):
        spec_from_config({**MAVERICK, **bad})


def test_weights_advice_names_a_tp_that_shards_the_heads(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 141 GB of weights over 21.6 GB per L4: 7 GPUs' worth, but 7 does not divide 64 heads.
    doc = plan_json(capsys, "--model", "llama-3-70b", "--gpu", "l4")
    note = next(n for n in doc["notes"] if "weights do not fit" in n)
    assert "use TP 8 " in note and "TP >= 7" not in note


# ERNIE-4.5-21B-A3B: experts in moe_num_experts, top-k in moe_k, MoE from layer 1 on.
ERNIE = {
    "model_type": "ernie4_5_moe", "num_hidden_layers": 28, "hidden_size": 2560,
    "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 12288, "moe_num_experts": 64, "moe_k": 6,
    "moe_intermediate_size": 1536, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
    "moe_layer_interval": 1, "vocab_size": 103424, "tie_word_embeddings": True,
}


@pytest.mark.parametrize(("extra", "total"), [
    ({}, 21_825_437_888), ({"moe_layer_end_index": 10}, 10_191_322_240),
    ({"moe_layer_interval": 2}, 12_928_761_216)])
def test_ernie_counts_moe_num_experts_and_its_layer_range(extra: dict[str, Any],
                                                          total: int) -> None:
    """Read as dense (its experts are in moe_num_experts), Ernie 4.5 counted 5 B, not 21 B."""
    counted = estimate_params(spec_from_config({**ERNIE, **extra}))
    assert counted.total == pytest.approx(total, rel=1e-6)  # Transformers' count
    moe = spec_from_config({**ERNIE, **extra}).moe
    assert moe is not None and moe.active_experts == 6


@pytest.mark.parametrize(("model_type", "top_k"), [("qwen3_moe", 8), ("mixtral", 2),
                                                   ("llama4_text", 1), ("qwen3_next", 10)])
def test_a_missing_top_k_is_the_familys_default(model_type: str, top_k: int) -> None:
    """One active expert for every family made Qwen3-MoE's prefill look 8x cheaper."""
    cfg = {k: v for k, v in QWEN15_MOE.items() if k != "num_experts_per_tok"}
    moe = spec_from_config({**cfg, "model_type": model_type}).moe
    assert moe is not None and moe.active_experts == top_k


@pytest.mark.parametrize("key", ["moe_k", "moe_topk", "num_experts_per_token", "moe_top_k",
                                 "top_k_experts"])
def test_the_top_k_spellings_of_other_families_are_read(key: str) -> None:
    cfg = {k: v for k, v in QWEN15_MOE.items() if k != "num_experts_per_tok"}
    moe = spec_from_config({**cfg, key: 3}).moe
    assert moe is not None and moe.active_experts == 3


def test_an_unknown_family_without_top_k_is_refused_with_the_fix() -> None:
    cfg = {k: v for k, v in QWEN15_MOE.items() if k != "num_experts_per_tok"}
    with pytest.raises(PlanError, match=r"add 'num_experts_per_tok'.*config\.json"):
        spec_from_config({**cfg, "model_type": "somebodys_moe"})
    with pytest.raises(PlanError, match="num_experts_per_tok"):
        spec_from_config({**QWEN15_MOE, "num_experts_per_tok": 61})  # more than routed


def test_an_all_moe_config_needs_no_dense_intermediate_size() -> None:
    """Qwen3.5-MoE's, DeepSeek-V4's and Solar Open's configs give only expert widths: the
    planner refused them for a missing intermediate_size that no layer uses."""
    cfg = {k: v for k, v in QWEN15_MOE.items() if k != "intermediate_size"}
    assert estimate_params(spec_from_config(cfg)) == estimate_params(
        spec_from_config(QWEN15_MOE))
    longcat = {**{k: v for k, v in cfg.items() if k != "moe_intermediate_size"},
               "expert_ffn_hidden_size": 1408}
    assert estimate_params(spec_from_config(longcat)) == estimate_params(spec_from_config(cfg))
    with pytest.raises(PlanError, match="intermediate_size"):
        spec_from_config({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})


# DBRX-132B: d_model/n_heads/n_layers, KV heads and experts in nested objects.
DBRX = {
    "model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40,
    "max_seq_len": 32768, "vocab_size": 100352,
    "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000},
    "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4},
}


def test_dbrx_reads_its_kv_heads_and_experts_from_the_nested_configs() -> None:
    """Read as 48 KV heads and a dense model, DBRX planned 6x its KV and 25 B weights;
    it is 132 B with 36 B active (Databricks' figures), KV heads 8 (vLLM's convertor)."""
    spec = spec_from_config(DBRX)
    assert spec.num_kv_heads == 8
    counted = estimate_params(spec)
    assert counted.total / 1e9 == pytest.approx(132, rel=0.01)
    assert counted.active / 1e9 == pytest.approx(36, rel=0.02)
    bare = spec_from_config({**DBRX, "attn_config": {}, "ffn_config": {}})
    assert bare.num_kv_heads == 48 and bare.moe is not None
    assert (bare.moe.routed_experts, bare.moe.active_experts,
            bare.moe.expert_intermediate) == (4, 1, 3584)   # DbrxFFNConfig's defaults
    with pytest.raises(PlanError, match="ffn_config"):
        spec_from_config({**DBRX, "ffn_config": [16]})


def test_num_dense_layers_leads_with_dense_layers() -> None:
    """AFMoE's and LFM2-MoE's first num_dense_layers layers have a dense MLP (vLLM's
    afmoe.py: moe_enabled = layer_idx >= num_dense_layers); all were counted as MoE."""
    moe = spec_from_config({**QWEN15_MOE, "num_dense_layers": 2}).moe
    assert moe is not None and moe.moe_layers == (False, False) + (True,) * 22
