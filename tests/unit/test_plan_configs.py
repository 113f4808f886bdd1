"""``kvtier plan`` on published configs that are not Llama-shaped: Falcon, MPT, GPT-2 and
GPT-BigCode key names and KV heads, DeciLM blocks, Qwen's sliding-window switch and
multimodal configs (tests/fixtures/plan/README.md says where each config comes from).
Expected bytes are worked out by hand in each test (bf16 KV, whole model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.kvmath import estimate_params, kv_bytes_per_sequence, kv_bytes_per_token
from kvtier.plan.model import AttentionKind, load_model, spec_from_config
from tests.unit.test_plan_cli import FIXTURES, plan, plan_json


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "config.json").read_text())


def write(tmp_path: Path, cfg: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# D1: Falcon, MPT, GPT-2, GPT-BigCode

def test_falcon_7b_multi_query_holds_one_kv_head() -> None:
    m = load_model(str(FIXTURES / "falcon-7b"))
    assert (m.num_attention_heads, m.num_kv_heads, m.head_dim) == (71, 1, 64)
    assert m.attention is AttentionKind.GQA
    assert kv_bytes_per_token(m, "bf16") == 32 * 2 * 1 * 64 * 2 == 8_192  # was 581,632
    # Tied embeddings and a two-matrix MLP (4 x 4544 wide): the published 6.92 B
    h = 4544
    layer = 2 * h * h + 2 * h * 64 + 2 * h + 2 * h * 4 * h  # q+o, k+v, norm, up+down
    assert estimate_params(m).total == 65024 * h + 32 * layer + h == 6_921_716_160


@pytest.mark.parametrize("name", ["falcon-40b", "falcon-40b-refinedweb"])
def test_falcon_40b_new_decoder_reads_its_kv_heads(name: str) -> None:
    m = load_model(str(FIXTURES / name))
    assert (m.num_layers, m.num_attention_heads, m.num_kv_heads) == (60, 128, 8)
    assert kv_bytes_per_token(m, "bf16") == 60 * 2 * 8 * 64 * 2 == 122_880  # was 1,966,080


FALCON_RW_1B = {"model_type": "falcon", "num_hidden_layers": 24, "hidden_size": 2048,
                "num_attention_heads": 32, "multi_query": False, "alibi": True,
                "vocab_size": 50304}


@pytest.mark.parametrize(("fields", "kv_heads"), [
    ({}, 32),  # multi_query false, no num_kv_heads: one KV head per attention head
    ({"multi_query": True}, 1),
    ({"model_type": "RefinedWebModel", "n_head": 32, "n_layer": 24, "multi_query": True,
      "num_attention_heads": None, "num_hidden_layers": None}, 1),
    ({"new_decoder_architecture": True, "num_kv_heads": 4, "multi_query": True}, 4),
    ({"model_type": "gpt_bigcode", "multi_query": None}, 1),  # BigCode's default: MQA
    ({"model_type": "gpt_bigcode", "multi_query": False}, 32),
])
def test_kv_heads_follow_each_family_s_rule(fields: dict[str, Any], kv_heads: int) -> None:
    assert spec_from_config({**FALCON_RW_1B, **fields}).num_kv_heads == kv_heads


@pytest.mark.parametrize(("fields", "needle"), [
    ({"model_type": "RefinedWeb", "new_decoder_architecture": True}, "must give 'n_head_kv'"),
    ({"multi_query": "false"}, "'multi_query' must be true or false"),
    ({"model_type": "mpt", "attn_config": {"attn_type": "grouped_query_attention"}},
     "'attn_config.attn_type'"),
])
def test_kv_heads_left_open_are_refused(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        spec_from_config({**FALCON_RW_1B, **fields})


def test_mpt_7b_old_key_names_plan_instead_of_being_refused() -> None:
    m = load_model(str(FIXTURES / "mpt-7b"))
    assert (m.num_layers, m.hidden_size, m.num_kv_heads, m.max_context) == (32, 4096, 32, 2048)
    assert kv_bytes_per_token(m, "bf16") == 32 * 2 * 32 * 128 * 2 == 524_288
    h = 4096  # tied embeddings, MLP of expansion_ratio 4 (up and down)
    assert estimate_params(m).total == 50432 * h + 32 * (4 * h * h + 2 * h + 8 * h * h) + h
    gqa = fixture("mpt-7b")
    gqa["attn_config"].update(attn_type="grouped_query_attention", kv_n_heads=8)
    assert spec_from_config(gqa).num_kv_heads == 8


def test_gpt2_key_names_and_mlp() -> None:
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768,
            "n_positions": 1024, "vocab_size": 50257, "n_inner": None}
    m = spec_from_config(gpt2)
    assert (m.num_layers, m.max_context, m.intermediate_size) == (12, 1024, 3072)
    assert kv_bytes_per_token(m, "fp32") == 12 * 2 * 768 * 4
    # 124.4 M published; biases and position embeddings (0.9 M) are not counted
    assert estimate_params(m).total / 124.4e6 == pytest.approx(1, abs=0.01)


# D2: DeciLM / Nemotron-NAS block_configs

def test_nemotron_super_holds_kv_in_its_49_attention_blocks(
        capsys: pytest.CaptureFixture[str]) -> None:
    m = load_model(str(FIXTURES / "nemotron-super-49b"))
    assert (m.num_layers, m.kv_layers, m.num_kv_heads, m.windowed_layers) == (80, 49, 8, 0)
    assert kv_bytes_per_token(m, "bf16") == 49 * 2 * 8 * 128 * 2 == 200_704  # was 2,621,440
    h = 8192  # ffn_mult 5.25: 2/3 x 5.25 x 8192 = 28,672 wide; a norm before each part
    attention = 2 * h * h + 2 * h * 1024 + h
    assert estimate_params(m).total == (128256 * h * 2 + 49 * attention
                                        + 80 * (3 * h * 28672 + h) + h) == 65_872_609_280
    doc = plan_json(capsys, "--model", str(FIXTURES / "nemotron-super-49b"), "--gpu", "h200",
                    "--tp", "2")
    assert doc["kv_bytes_per_token"] == 200_704
    (note,) = [n for n in doc["notes"] if "layers hold attention KV" in n]
    assert "only 49 of 80" in note and "block by block" in note
    assert not any("connector" in n for n in doc["notes"])  # one full-attention group


def test_block_configs_count_linear_and_skipped_parts() -> None:
    h = 1024
    full = {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 1.5}}  # 1,024 wide
    linear = {"attention": {"replace_with_linear": True}, "ffn": {"replace_with_linear": True}}
    none = {"attention": {"no_op": True}, "ffn": {"no_op": True}}
    cfg = {"model_type": "nemotron-nas", "num_hidden_layers": 3, "hidden_size": h,
           "num_attention_heads": 8, "vocab_size": 100, "block_configs": [full, linear, none]}
    m = spec_from_config(cfg)
    assert (m.kv_layers, m.num_kv_heads) == (1, 2)
    attention = 2 * h * h + 2 * h * 256
    counted = estimate_params(m)
    assert counted.total == 200 * h + (attention + h) + (3 * h * 1024 + h) + 2 * (h * h + h) + h
    assert counted.embeddings == 200 * h and counted.experts == 0


@pytest.mark.parametrize(("change", "needle"), [
    ({"n_heads_in_group": 4}, r"'block_configs\[\]\.attention\.n_heads_in_group' differs "
                              r"between layers \(8 from layer 0, 4 from layer 5\).*set every "
                              "one to 4"),
    ({"n_heads_in_group": 7}, r"'block_configs\[5\]\.attention\.n_heads_in_group' must divide"),
    ({"n_heads_in_group": None}, r"'block_configs\[5\]\.attention\.n_heads_in_group' must"),
    ({"no_op": "yes"}, r"'block_configs\[5\]\.attention\.no_op' must be true or false"),
])
def test_block_configs_a_plan_cannot_model_are_one_line_errors(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, change: dict[str, Any],
        needle: str) -> None:
    cfg = fixture("nemotron-super-49b")
    assert cfg["block_configs"][5]["attention"]["n_heads_in_group"] == 8
    cfg["block_configs"][5]["attention"].update(change)
    code, out, err = plan(capsys, "--model", write(tmp_path, cfg))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("kvtier plan: error:")
    with pytest.raises(PlanError, match=needle):
        spec_from_config(cfg)


# D3: use_sliding_window for any model type

@pytest.mark.parametrize("name", ["qwen2.5-vl-7b", "qwen2.5-vl-7b-nested"])
def test_qwen2_5_vl_sliding_window_is_off_as_its_config_says(name: str) -> None:
    m = load_model(str(FIXTURES / name))
    assert m.windowed_layers == 0 and m.max_context == 128_000
    # 28 layers x 2 x 4 KV heads x 128 x 2 B = 57,344 B per token, for every token held
    assert kv_bytes_per_sequence(m, "bf16", 100_000) == 100_000 * 57_344  # was 1,879,048,192


def test_use_sliding_window_true_slides_from_max_window_layers_in_any_model_type() -> None:
    cfg = {"model_type": "some_vl_text", "num_hidden_layers": 4, "hidden_size": 256,
           "num_attention_heads": 4, "vocab_size": 1000, "sliding_window": 64,
           "max_window_layers": 2, "use_sliding_window": True}
    assert spec_from_config(cfg).layer_windows == (None, None, 64, 64)
    assert spec_from_config({**cfg, "use_sliding_window": False}).windowed_layers == 0
    qwen3 = {k: v for k, v in cfg.items() if k != "use_sliding_window"}
    assert spec_from_config({**qwen3, "model_type": "qwen3_moe"}).windowed_layers == 0


# D5: a text_config without vocab_size

def test_gemma3_without_vocab_takes_the_config_class_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Gemma3TextConfig defaults vocab_size to 262,208, which vLLM then serves
    ref = str(FIXTURES / "gemma-3-27b-it")
    assert load_model(ref).vocab_size == 262_208
    doc = plan_json(capsys, "--model", ref, "--params", "27B")
    assert doc["kv_bytes_per_token"] == 62 * 2 * 16 * 128 * 2 == 507_904
    assert doc["weights_bytes"] == 54_000_000_000  # 27 B x 2 B (bf16)
    assert doc["model"]["sliding_window_layers"] == 52


def test_text_config_without_vocab_plans_the_kv_and_asks_for_params(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = fixture("gemma-3-27b-it")  # as a family whose config class gives no vocabulary
    cfg["model_type"] = cfg["text_config"]["model_type"] = "mistral3"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(str(tmp_path)).vocab_size == 0
    code, out, err = plan(capsys, "--model", str(tmp_path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "'vocab_size' is missing" in err and "pass --params" in err


def test_vocab_size_of_the_outer_config_counts() -> None:
    cfg = fixture("gemma-3-27b-it")
    cfg["vocab_size"] = 262_208
    counted = estimate_params(spec_from_config(cfg))
    assert counted.embeddings == 262_208 * 5376  # tied, as Gemma's config class defaults
