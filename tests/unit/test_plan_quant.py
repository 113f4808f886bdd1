"""Weights of quantized checkpoints: which parts each method stores in fewer bits, and a
refusal (never bf16) for a method the plan does not model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.plan.kvmath import estimate_params, weights_bytes, weights_format
from kvtier.plan.model import load_model, spec_from_config
from tests.unit.test_plan_cli import FIXTURES, LLAMA, plan, plan_json

QWEN_AWQ = FIXTURES / "qwen2.5-7b-awq"


def test_awq_stores_linear_layers_in_int4_and_embeddings_in_fp16(
        capsys: pytest.CaptureFixture[str]) -> None:
    counted = estimate_params(load_model(str(QWEN_AWQ)))
    embed = 152064 * 3584 * 2  # embeddings and LM head, fp16 as the checkpoint
    assert (counted.total, counted.embeddings, counted.experts) == (7_615_616_512, embed, 0)
    # 4 bits, and per group of 128 an fp16 scale and a 4-bit zero point
    expected = embed * 2 + (7_615_616_512 - embed) * (4 + 20 / 128) / 8
    assert expected == 5_570_253_934
    doc = plan_json(capsys, "--model", str(QWEN_AWQ))
    assert doc["weights_bytes"] == 5_570_253_934  # was 15,231,233,024 (fp16)
    assert doc["weights_dtype"] == "awq int4"
    code, out, _ = plan(capsys, "--model", str(QWEN_AWQ))
    assert code == 0 and "weights (awq int4)" in out and "5.57 GB total" in out


def test_weights_dtype_overrides_and_params_rescale_a_quantized_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    over = plan_json(capsys, "--model", str(QWEN_AWQ), "--weights-dtype", "bf16")
    assert (over["weights_bytes"], over["weights_dtype"]) == (7_615_616_512 * 2, "bf16")
    scaled = plan_json(capsys, "--model", str(QWEN_AWQ), "--params", "15231233024")
    assert scaled["weights_bytes"] == 2 * 5_570_253_934  # twice the parameters, same mix


def test_mxfp4_quantizes_only_gpt_oss_experts(capsys: pytest.CaptureFixture[str]) -> None:
    counted = estimate_params(load_model(str(FIXTURES / "gpt-oss-120b")))
    experts = 36 * 128 * 3 * 2880 * 2880  # 36 layers x 128 experts x gate, up, down
    assert (counted.total, counted.experts) == (116_789_232_960, experts)
    rest = counted.total - experts  # attention, router, embeddings: bf16
    assert rest * 2 + experts * 4.25 / 8 == 65_168_968_320  # 4 bits + an 8-bit scale per 32
    doc = plan_json(capsys, "--model", str(FIXTURES / "gpt-oss-120b"), "--gpu", "h200")
    assert doc["weights_bytes"] == 65_168_968_320  # was 233,578,465,920 (bf16)
    assert doc["weights_dtype"] == "mxfp4 experts, bf16 rest"


def quantized(q: dict[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    return {**LLAMA, "torch_dtype": dtype, "quantization_config": q}


_EMBED = 128256 * 4096 * 2
_REST = 8_030_261_248 - _EMBED


@pytest.mark.parametrize(("q", "label", "bits"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}, "gptq int4",
     4 + 20 / 128),
    ({"quant_method": "gptq_marlin", "bits": 8, "group_size": -1}, "gptq int8", 8),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": False},
     "awq int4", 4 + 16 / 64),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": True}, "bitsandbytes nf4", 4 + 8 / 64 + 32 / 64 / 256),
    ({"load_in_8bit": True}, "bitsandbytes int8", 8),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                           "strategy": "group", "group_size": 128}}}},
     "compressed-tensors int4", 4 + 16 / 128),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "compressed-tensors fp8", 8),
])
def test_weight_only_methods_keep_embeddings_at_the_checkpoint_dtype(
        q: dict[str, Any], label: str, bits: float) -> None:
    m = spec_from_config(quantized(q))
    fmt = weights_format(m)
    assert fmt.label == label
    assert weights_bytes(estimate_params(m), fmt) == round(_EMBED * 2 + _REST * bits / 8)


def test_fp8_counts_linear_weights_at_one_byte_and_embeddings_at_their_dtype() -> None:
    """vLLM's fp8 quantizes linear layers only: Llama-3-8B's 2 x 525,336,576 embedding and
    LM-head weights stay bf16 (they were counted at one byte: 1.05 GB under-planned)."""
    m = spec_from_config(quantized({"quant_method": "fbgemm_fp8"}))
    assert weights_bytes(estimate_params(m), weights_format(m)) == \
        8_030_261_248 + 2 * 525_336_576
    assert weights_format(m).label == "fp8"


@pytest.mark.parametrize(("q", "needle"), [
    ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq' is not modelled"),
    ({"quant_method": "awq"}, "'awq' gives no usable 'bits'"),
    ({"bits": 4}, "has no quant_method"),
    ({"quant_method": "bitsandbytes"}, "sets neither load_in_4bit nor load_in_8bit"),
    ({"quant_method": "compressed-tensors"}, "no config_groups"),
    ("awq", "is 'awq', not an object"),
])
def test_a_quantization_the_plan_does_not_model_is_refused_not_bf16(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, q: object, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "quantization_config": q}))
    code, out, err = plan(capsys, "--model", str(path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert needle in err and "--weights-dtype" in err and "bf16" in err
    doc = plan_json(capsys, "--model", str(path), "--weights-dtype", "int4")
    assert (doc["weights_bytes"], doc["weights_dtype"]) == (8_030_261_248 // 2, "int4")


def test_mxfp4_without_experts_is_refused(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "quantization_config": {"quant_method": "mxfp4"}}))
    code, _, err = plan(capsys, "--model", str(path))
    assert code == 2 and "quantizes MoE experts and this model has none" in err


def test_multimodal_quantization_config_sits_in_the_outer_config() -> None:
    cfg = json.loads((FIXTURES / "qwen2.5-vl-7b-nested" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    assert weights_format(spec_from_config(cfg)).label == "awq int4"
