"""Mutation-review pins for ``kvtier plan``'s report and command line: what the model line
and the --json document say about layers without KV and the node, and the CLI's exit codes
and unit conversions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.plan.model import load_model
from kvtier.plan.report import kv_shapes
from tests.unit.test_plan_cli import FIXTURES, plan, plan_json

NEMOTRON = str(FIXTURES / "nemotron-super-49b")


def test_kv_shapes_count_only_layers_that_hold_kv() -> None:
    """Nemotron-Super-49B keeps attention in 49 of 80 layers: kv_shapes (and the --json
    kv_shapes) must not count the 31 without KV."""
    m = load_model(NEMOTRON)
    assert m.kv_layers == 49
    assert sum(s["layers"] for s in kv_shapes(m)) == 49


def test_model_line_says_how_many_layers_hold_kv(capsys: pytest.CaptureFixture[str]) -> None:
    """The human model line says "80 layers (49 with KV)", not only "80 layers"."""
    code, out, _ = plan(capsys, "--model", NEMOTRON, "--gpu", "h200")
    assert code == 0 and "80 layers (49 with KV)" in out


def test_json_reports_the_node_s_gpus_beside_tp(capsys: pytest.CaptureFixture[str]) -> None:
    """--gpus 8 --tp 2 is four engine instances on eight GPUs: hardware.gpus is 8."""
    doc = plan_json(capsys, "--model", "llama-3-8b", "--gpus", "8", "--tp", "2")
    assert (doc["hardware"]["gpus"], doc["hardware"]["tp"], doc["hardware"]["replicas"]) \
        == (8, 2, 4)


def test_param_counts_parse_their_suffixes_and_refuse_zero() -> None:
    """--params 560M is 560 million (and 1.5T 1.5 trillion); 0 is no count."""
    import argparse

    from kvtier.plan.cli import _count

    assert (_count("560M"), _count("7.6B"), _count("1.5T")) == (560_000_000, 7_600_000_000,
                                                              1_500_000_000_000)
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        _count("0")


def test_reserve_gb_is_decimal(capsys: pytest.CaptureFixture[str]) -> None:
    """--reserve-gb 2 keeps 2,000,000,000 B per GPU (decimal GB, as every size here)."""
    doc = plan_json(capsys, "--model", "llama-3-8b", "--reserve-gb", "2")
    assert doc["hardware"]["reserve_bytes"] == 2_000_000_000


def test_auto_kv_dtype_of_an_fp32_checkpoint_is_bf16() -> None:
    """vLLM serves an fp32 checkpoint's KV in bf16 (--kv-cache-dtype auto): planning 4 B
    per value doubled the KV."""
    from kvtier.plan.cli import auto_kv_dtype
    from kvtier.plan.model import spec_from_config
    from tests.unit.test_plan_cli import LLAMA

    assert auto_kv_dtype(spec_from_config({**LLAMA, "torch_dtype": "float32"})) == "bf16"
    assert auto_kv_dtype(spec_from_config({**LLAMA, "torch_dtype": "float16"})) == "fp16"


def test_auto_kv_dtype_without_a_torch_dtype_is_bf16() -> None:
    """A config that names no dtype plans bf16 KV (2 B per value)."""
    from kvtier.plan.cli import auto_kv_dtype
    from kvtier.plan.model import spec_from_config
    from tests.unit.test_plan_cli import LLAMA

    cfg = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    assert auto_kv_dtype(spec_from_config(cfg)) == "bf16"


def test_live_stats_with_json_keeps_stdout_json(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """--json --live-stats prints the live sizing on stderr: stdout stays one JSON document
    a script can parse."""
    import json

    p = tmp_path / "s.json"
    p.write_text('{"policy": {"tiers": {"cpu": {"mrc": [{"scale": 1, "hit_rate": 0.5}]}}}}')
    code, out, err = plan(capsys, "--model", "llama-2-7b", "--json", "--live-stats", str(p))
    assert code == 0 and err.strip()
    assert json.loads(out)["model"]["name"]
