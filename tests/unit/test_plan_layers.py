"""``kvtier plan`` on hybrid and chunked-attention geometries: which layers hold KV.

The configs carry the fields of the published checkpoints' config.json (Qwen3-Next-80B-A3B,
Jamba v0.1, Llama 4 Scout, Nemotron-H, Granite 4, MiniMax-Text-01, Gemma 3, Command A);
the expected bytes are worked out by hand in each test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.plan import PlanError
from kvtier.plan.kvmath import kv_bytes_per_sequence, kv_bytes_per_token
from kvtier.plan.layers import NO_KV
from kvtier.plan.model import spec_from_config
from tests.unit.test_plan_cli import plan_json


def config(**fields: Any) -> dict[str, Any]:
    base = {"num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000,
            "intermediate_size": 4096, "max_position_embeddings": 262144,
            "torch_dtype": "bfloat16"}
    return {**base, **fields}


QWEN3_NEXT = config(model_type="qwen3_next", num_hidden_layers=48, hidden_size=2048,
                    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                    full_attention_interval=4, num_experts=512, num_experts_per_tok=10,
                    moe_intermediate_size=512, vocab_size=151936, linear_num_value_heads=32)


def test_qwen3_next_holds_kv_in_every_fourth_layer() -> None:
    m = spec_from_config(QWEN3_NEXT)
    assert (m.num_layers, m.kv_layers, m.state_layers) == (48, 12, 36)
    assert m.layer_windows[:4] == (NO_KV, NO_KV, NO_KV, None)
    # 12 layers x K and V x 2 KV heads x 256 x 2 B
    assert kv_bytes_per_token(m, "bf16") == 12 * 2 * 2 * 256 * 2 == 24_576
    assert kv_bytes_per_sequence(m, "bf16", 1000) == 1008 * 24_576  # whole 16-token pages


def test_jamba_attention_every_eighth_layer_from_the_fifth() -> None:
    m = spec_from_config(config(model_type="jamba", num_hidden_layers=32, hidden_size=4096,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=None,
                                attn_layer_period=8, attn_layer_offset=4, num_experts=16,
                                sliding_window=None))
    kv = [i for i, w in enumerate(m.layer_windows) if w != NO_KV]
    assert kv == [4, 12, 20, 28] and m.state_layers == 28
    assert kv_bytes_per_token(m, "bf16") == 4 * 2 * 8 * 128 * 2


def test_llama4_chunked_layers_keep_one_chunk_and_nope_layers_everything() -> None:
    cfg: dict[str, Any] = {
        "model_type": "llama4", "torch_dtype": "bfloat16",
        "text_config": config(model_type="llama4_text", num_hidden_layers=48,
                              hidden_size=5120, num_attention_heads=40,
                              num_key_value_heads=8, attention_chunk_size=8192,
                              num_local_experts=16, vocab_size=202048,
                              max_position_embeddings=10485760)}
    m = spec_from_config(cfg)
    assert m.layer_windows[:4] == (8192, 8192, 8192, None)  # every 4th layer is NoPE, global
    assert (m.windowed_layers, m.kv_layers, m.state_layers) == (36, 48, 0)
    per_layer = 2 * 8 * 128 * 2
    assert kv_bytes_per_sequence(m, "bf16", 32768) == (12 * 32768 + 36 * 8192) * per_layer
    # an explicit list wins over the interval
    cfg["text_config"]["no_rope_layers"] = [0] * 24 + [1] * 24
    assert spec_from_config(cfg).layer_windows == (None,) * 24 + (8192,) * 24


def test_nemotron_h_pattern_one_character_per_layer() -> None:
    pattern = "M-M-M-M*-M-M-M-M*-"
    m = spec_from_config(config(model_type="nemotron_h", num_hidden_layers=len(pattern),
                                hybrid_override_pattern=pattern))
    assert [i for i, w in enumerate(m.layer_windows) if w != NO_KV] == [7, 16]
    assert (m.kv_layers, m.state_layers) == (2, 8)  # the 8 '-' layers are MLP only
    assert kv_bytes_per_token(m, "fp16") == 2 * 2 * 2 * 128 * 2


def test_granite4_legacy_names_and_minimax_type_list() -> None:
    granite = spec_from_config(config(model_type="granitemoehybrid",
                                      layer_types=["mamba"] * 5 + ["attention"] * 3))
    assert granite.layer_windows == (NO_KV,) * 5 + (None,) * 3
    minimax = spec_from_config(config(model_type="minimax", attn_type_list=[0] * 7 + [1]))
    assert (minimax.kv_layers, minimax.state_layers) == (1, 7)


def test_sliding_window_patterns_of_gemma3_and_cohere2() -> None:
    gemma3 = spec_from_config(config(model_type="gemma3_text", num_hidden_layers=62,
                                     sliding_window=1024, sliding_window_pattern=6))
    assert (gemma3.windowed_layers, gemma3.kv_layers) == (52, 62)
    assert gemma3.layer_windows[4:6] == (1024, None)
    cohere = spec_from_config(config(model_type="cohere2", sliding_window=4096))
    assert cohere.layer_windows == (4096, 4096, 4096, None) * 2  # every 4th layer global


def test_unknown_layer_types_count_as_full_attention() -> None:
    m = spec_from_config(config(layer_types=["full_attention", "some_new_attention"] * 4,
                                sliding_window=512))
    assert m.layer_windows == (None,) * 8 and m.kv_layers == 8


@pytest.mark.parametrize(("fields", "words"), [
    ({"layer_types": ["full_attention"] * 7}, "'layer_types' has 7 entries"),
    ({"hybrid_override_pattern": "M*M"}, "pattern has 3 layers"),
    ({"layer_types": ["linear_attention"] * 8}, "no layer holds attention KV"),
])
def test_inconsistent_layer_fields_are_named(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(PlanError, match=words):
        spec_from_config(config(**fields))


def test_the_plan_of_a_hybrid_model_says_what_it_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    doc = plan_json(capsys, "--model", str(tmp_path), "--gpu", "h200")
    assert doc["kv_bytes_per_token"] == 24_576
    assert (doc["model"]["kv_layers"], doc["model"]["state_layers"]) == (12, 36)
    (note,) = [n for n in doc["notes"] if n.startswith("hybrid model")]
    assert "only 12 of 48 layers hold attention KV" in note and "own blocks" in note
    assert "--params" not in note   # its DeltaNet layers are counted as such
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_NEXT, "model_type": "new_hybrid",
                                                      "full_attention_interval": 4}))
    (guessed,) = [n for n in plan_json(capsys, "--model", str(tmp_path), "--gpu", "h200")[
        "notes"] if n.startswith("hybrid model")]
    assert "as if every layer were attention + MLP: pass --params" in guessed
    (refused,) = [n for n in doc["notes"] if "connector refuses this model at start" in n]
    assert "disable-sliding-window" not in refused   # recurrent layers: no such way out
    full = plan_json(capsys, "--model", "llama-3-8b")
    assert not any("connector" in n or "hybrid" in n for n in full["notes"])


def test_windowed_layers_beside_full_ones_are_planned_as_the_connector_runs_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With kvtier's connector vLLM runs without its hybrid KV cache manager: a Command A
    (3 of 4 layers windowed at 4096) keeps every token in every layer. A model of windowed
    layers alone is refused by the connector, and planned with its windows."""
    mixed = config(model_type="cohere2", sliding_window=4096)
    (tmp_path / "config.json").write_text(json.dumps(mixed))
    doc = plan_json(capsys, "--model", str(tmp_path), "--gpu", "h200", "--context",
                    "32768", "--max-output", "0")
    m = spec_from_config(mixed)
    everything = kv_bytes_per_token(m, "bf16") * 32768
    windowed = kv_bytes_per_sequence(m, "bf16", 32768, 16)
    assert doc["kv_bytes_per_sequence"]["p99"] == everything > windowed
    (note,) = [n for n in doc["notes"] if "window of 4,096" in n]
    assert "keep every token" in note and f"{windowed / 1e9:.2f} GB without kvtier" in note
    assert not any("refuses" in n for n in doc["notes"])
    alone = config(model_type="mistral", sliding_window=4096)
    (tmp_path / "config.json").write_text(json.dumps(alone))
    doc = plan_json(capsys, "--model", str(tmp_path), "--gpu", "h200", "--context",
                    "32768", "--max-output", "0")
    assert doc["kv_bytes_per_sequence"]["p99"] == kv_bytes_per_sequence(
        spec_from_config(alone), "bf16", 32768, 16)
    (refused,) = [n for n in doc["notes"] if "refuses this model at start" in n]
    assert "--disable-sliding-window it is served (max_model_len capped at the 4,096" in refused


def test_llama4_chunked_layers_keep_every_token_without_kvtier_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM 0.32 turns its hybrid KV cache manager off for chunked local attention by
    default (unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1), connector or not:
    Llama 4's chunked layers are allocated as full attention either way, so the plan must
    not put the difference on kvtier."""
    scout = {"model_type": "llama4", "torch_dtype": "bfloat16",
             "text_config": config(model_type="llama4_text", num_hidden_layers=48,
                                   hidden_size=5120, num_attention_heads=40,
                                   num_key_value_heads=8, attention_chunk_size=8192,
                                   num_local_experts=16, vocab_size=202048,
                                   max_position_embeddings=10485760)}
    (tmp_path / "config.json").write_text(json.dumps(scout))
    doc = plan_json(capsys, "--model", str(tmp_path), "--gpu", "h200", "--tp", "4",
                    "--context", "100000", "--max-output", "0")
    m = spec_from_config(scout)
    everything = kv_bytes_per_token(m, "bf16") * 100_000
    windowed = kv_bytes_per_sequence(m, "bf16", 100_000, 16)
    assert doc["kv_bytes_per_sequence"]["p99"] == everything > windowed
    (note,) = [n for n in doc["notes"] if "window of 8,192" in n]
    assert "with or without kvtier" in note and "without kvtier)" not in note
    assert f"{windowed / 1e9:.2f} GB only with VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV" \
        in note
