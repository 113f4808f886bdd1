"""``kvtier plan`` end to end through its argparse entry point (add_parser + run)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kvtier.plan import add_parser
from tests.support.cli import run_subcommand
from tests.support.paths import MOONCAKE_TRACE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plan"
MOONCAKE = MOONCAKE_TRACE


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_subcommand(capsys, add_parser, "plan", *argv)


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = plan(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_llama_2_13b_fp16_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, "--model", "llama-2-13b", "--kv-dtype", "fp16")
    assert code == 0
    assert "819,200 B" in out
    p50 = next(line for line in out.splitlines() if line.startswith("P50"))
    assert "2,048" in p50 and "1.68 GB" in p50


def test_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "llama-2-13b", "--kv-dtype", "fp16")
    assert doc["kv_bytes_per_token"] == 819_200
    assert doc["kv_bytes_per_sequence"]["p50"] == 819_200 * 2048
    assert set(doc["max_sequences_in_hbm"]) == {"p50", "p95", "p99"}
    assert doc["weights_bytes"] == 13_015_864_320 * 2


def test_14b_params_in_bf16_is_28_gb_of_weights(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "qwen2.5-14b", "--params", "14B",
                    "--weights-dtype", "bf16")
    assert doc["weights_bytes"] == 28_000_000_000
    counted = plan_json(capsys, "--model", "qwen2.5-14b")  # 14.77 B counted from the config
    assert counted["weights_bytes"] / 1e9 == pytest.approx(29.5, abs=0.1)


def test_sequences_that_fit_and_spill_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    # 40 GB x 0.5 = 20 GB; weights 8,030,261,248 x 2 B = 16.06 GB; 3,939,477,504 B left.
    # A 2,048-token sequence is 2048 x 131,072 = 268,435,456 B: 14 fit; 4,096 tokens: 7.
    doc = plan_json(capsys, "--model", "llama-3-8b", "--gpu-mem-gb", "40", "--mem-util", "0.5",
                    "--context", "2048,2048,4096", "--concurrency", "10")
    assert doc["kv_budget_bytes_per_gpu"] == 20_000_000_000 - 16_060_522_496
    assert doc["max_sequences_in_hbm"] == {"p50": 14, "p95": 14, "p99": 7}
    assert doc["spill_bytes_p99"] == (10 - 7) * 4096 * 131_072
    assert doc["tiers"]["redis"]["bytes"] == 0  # one engine instance


def test_replicas_multiply_what_fits(capsys: pytest.CaptureFixture[str]) -> None:
    one = plan_json(capsys, "--model", "llama-3-70b", "--tp", "4")
    two = plan_json(capsys, "--model", "llama-3-70b", "--tp", "4", "--gpus", "8")
    assert two["max_sequences_in_hbm"]["p50"] == 2 * one["max_sequences_in_hbm"]["p50"]
    assert two["weights_bytes_per_gpu"] == one["weights_bytes_per_gpu"]
    assert two["tiers"]["redis"]["bytes"] > 0  # shared across the two instances


def test_tiers_hold_every_tp_rank_s_copy_of_replicated_kv_heads(
        capsys: pytest.CaptureFixture[str]) -> None:
    # llama-3-8b's 8 KV heads over TP 16: two ranks hold each head, and the connector stores
    # each rank's KV under its own namespace, so the tiers hold two copies of every token.
    gib = 1 << 30
    trace = str(FIXTURES.parent / "traces" / "mooncake_small.jsonl")
    for tp, copies in (("8", 1), ("16", 2)):
        doc = plan_json(capsys, "--model", "llama-3-8b", "--gpus", tp, "--tp", tp,
                        "--concurrency", "256", "--context", "8192,16384,32768")
        assert doc["stored_copies"] == copies
        one_copy = doc["spill_bytes_p99"] + doc["kv_pool_bytes"]
        assert doc["tiers"]["cpu"]["bytes"] == -(-one_copy * copies // gib) * gib
        assert doc["tiers"]["nvme"]["bytes"] == 4 * doc["tiers"]["cpu"]["bytes"]
    assert "x 2 copies" in doc["tiers"]["cpu"]["why"]
    assert any("kvtier's tiers" in n for n in doc["notes"])
    # The trace's reused prefixes: 5 blocks x 512 tokens x 131,072 B = 0.34 GB per copy.
    one, two = (plan_json(capsys, "--model", "llama-3-8b", "--gpus", tp, "--tp", tp,
                          "--trace", trace)["tiers"]["nvme"]["why"] for tp in ("8", "16"))
    assert "5 blocks x 512 tokens = 0.3 GB" in one
    assert "5 blocks x 512 tokens x 2 copies (one per TP rank that holds it) = 0.7 GB" in two


def test_the_daemon_s_own_memory_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    # llama-3-8b: 131,072 B per token; kvtier's default block of 256 tokens is 32 MiB per
    # rank at TP 1, half that at TP 2. Every block the cpu and nvme tiers can hold: 1,536 B.
    counted = {}
    for tp, block in ((1, 256 * 131_072), (2, 256 * 65_536)):
        doc = plan_json(capsys, "--model", "llama-3-8b", "--tp", str(tp), "--gpus", str(tp))
        held = doc["tiers"]["cpu"]["bytes"] + doc["tiers"]["nvme"]["bytes"]
        blocks = -(-held // block)
        assert doc["daemon_memory"] == {"blocks": blocks, "bytes": blocks * 1536,
                                        "block_tokens": 256, "bytes_per_block": 1536}
        assert not any("daemon's own memory" in n for n in doc["notes"])
        counted[tp] = blocks
    code, out, _ = plan(capsys, "--model", "llama-3-8b")
    (row,) = [line for line in out.splitlines() if line.startswith("daemon")]
    assert code == 0 and f"{counted[1]:,} blocks of 256 tokens" in row
    # the connector's default is a multiple of the engine's page: 8 pages of 32 tokens
    assert plan_json(capsys, "--model", "llama-3-8b", "--block-size", "32",
                     "--tokens-per-block", "64")["daemon_memory"]["block_tokens"] == 64


def test_tiny_blocks_get_a_note_about_the_daemon_s_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    # One token per block: 131,072 B, so the index costs 1,536 / 131,072 = 1.2% of every
    # tier byte, about 6% of the cpu tier once the nvme tier's blocks are counted too.
    doc = plan_json(capsys, "--model", "llama-3-8b", "--block-size", "1",
                    "--tokens-per-block", "1")
    (note,) = [n for n in doc["notes"] if "daemon's own memory" in n]
    cpu = doc["tiers"]["cpu"]["bytes"]
    assert f"{doc['daemon_memory']['bytes'] / cpu:.0%}" in note
    assert doc["daemon_memory"]["bytes"] > 0.02 * cpu


@pytest.mark.parametrize("tokens", ["20", "0", "-16"])
def test_tokens_per_block_must_be_whole_pages(capsys: pytest.CaptureFixture[str],
                                              tokens: str) -> None:
    code, _, err = plan(capsys, "--model", "llama-3-8b", "--tokens-per-block", tokens)
    assert code != 0 and "--tokens-per-block" in err and "multiple of --block-size 16" in err


def test_max_output_is_added_to_the_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "llama-3-8b", "--context", "1000,2000,3000",
                    "--max-output", "500")
    assert doc["sequence_tokens"] == {"p50": 1500, "p95": 2500, "p99": 3500}


def test_context_beyond_the_model_window_is_capped_with_a_note(
        capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "llama-2-13b", "--context", "2048,4096,16384")
    assert doc["sequence_tokens"]["p99"] == 4096
    assert any("16,384" in n and "4,096" in n for n in doc["notes"])


@pytest.mark.parametrize("name", ["llama-2-13b", "llama-3-8b", "mistral-7b", "deepseek-v3"])
def test_config_json_plans_like_the_preset(capsys: pytest.CaptureFixture[str],
                                           name: str) -> None:
    common = ("--context", "2048,16384,65536", "--tp", "1", "--gpu", "h200")
    preset = plan_json(capsys, "--model", name, *common)
    from_file = plan_json(capsys, "--model", str(FIXTURES / name / "config.json"), *common)
    preset.pop("model"), from_file.pop("model")
    assert from_file == preset
    folder = plan_json(capsys, "--model", str(FIXTURES / name), *common)
    folder.pop("model")
    assert folder == preset


def test_trace_gives_the_context_percentiles(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "llama-3-8b", "--trace",
                    str(FIXTURES / "mooncake_small.jsonl"))
    assert doc["sequence_tokens"] == {"p50": 1024, "p95": 2100, "p99": 2100}
    assert doc["kv_bytes_per_sequence"]["p99"] == 2112 * 131_072  # whole 16-token pages
    assert doc["prefill_saving"]["prefix_share"] == pytest.approx(2560 / 4848)


def test_trace_and_max_output_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "--model", "llama-3-8b", "--max-output", "10", "--trace",
                          str(FIXTURES / "mooncake_small.jsonl"))
    assert code == 2 and out == ""
    assert "--max-output" in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "gpt-9"], "presets: llama-2-7b"),
    (["--model", "llama-3-8b", "--kv-dtype", "int4"], "--kv-dtype"),
    (["--model", "llama-3-8b", "--tp", "3"], "--tp 3"),
    (["--model", "llama-3-8b", "--gpus", "3", "--tp", "2"], "multiple of --tp"),
    (["--model", "llama-3-8b", "--gpus", "4", "--tp", "0"], "--tp must be positive"),
    (["--model", "llama-3-8b", "--gpus", "1", "--tp", "-4"], "--tp must be positive"),
    (["--model", "llama-3-8b", "--context", "8k"], "--context"),
    (["--model", "llama-3-8b", "--context", "4096,2048,8192"], "must not decrease"),
    (["--model", "llama-3-8b", "--gpu", "tpu-v5"], "unknown GPU"),
    (["--model", "llama-3-8b", "--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
])
def test_bad_input_is_exit_2_with_a_message(capsys: pytest.CaptureFixture[str],
                                            argv: list[str], needle: str) -> None:
    code, out, err = plan(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and err.startswith("kvtier plan: error:")


def test_malformed_config_json_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 32,')
    code, _, err = plan(capsys, "--model", str(bad))
    assert code == 2 and "cannot read model config" in err


def test_weights_that_do_not_fit_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "llama-3-70b", "--gpu", "l4")
    assert doc["max_sequences_in_hbm"] == {"p50": 0, "p95": 0, "p99": 0}
    assert any("weights do not fit" in n for n in doc["notes"])


def test_mla_under_tp_notes_the_replicated_latent(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "deepseek-v3", "--gpu", "h200", "--tp", "8")
    assert doc["kv_bytes_per_token_per_gpu"] == 70_272
    assert doc["weights_dtype"] == "fp8"
    assert any("MLA" in n for n in doc["notes"])
    # every rank holds the whole latent in HBM; an engine offloading it saves one copy
    assert doc["stored_copies"] == 1


def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "kv.png"
    code, _, err = plan(capsys, "--model", "llama-3-8b", "--plot", str(out))
    assert code == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_plot_without_matplotlib_says_how_to_install(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    code, out, err = plan(capsys, "--model", "llama-3-8b", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and out == ""
    assert "matplotlib" in err and "pip install" in err


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared Mooncake trace not present")
def test_real_mooncake_trace(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "deepseek-v3", "--gpu", "h200", "--tp", "8",
                    "--trace", str(MOONCAKE))
    p = doc["sequence_tokens"]
    assert p["p50"] < p["p95"] < p["p99"] < doc["model"]["max_context"]
    assert doc["kv_bytes_per_sequence"]["p99"] == -(-p["p99"] // 16) * 16 * 70_272
    assert 0.6 < doc["prefill_saving"]["prefix_share"] < 0.7
    capped = plan_json(capsys, "--model", "llama-3-8b", "--trace", str(MOONCAKE))
    assert capped["sequence_tokens"]["p99"] == 8192  # Llama-3's context window



def test_a_page_of_no_tokens_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan(capsys, "--model", "llama-3-8b", "--block-size", "0")
    assert code != 0 and "--block-size must be positive" in err


LLAMA = json.loads((FIXTURES / "llama-3-8b" / "config.json").read_text())


@pytest.mark.parametrize(("fields", "needle"), [
    ({"num_hidden_layers": 10**12}, "'num_hidden_layers' must be"),
    ({"num_hidden_layers": 10_001}, "'num_hidden_layers' must be"),
    ({"hidden_size": 10**30}, "'hidden_size' must be"),
    ({"vocab_size": 2**40}, "'vocab_size' must be"),
    ({"kv_lora_rank": 10**12}, "'kv_lora_rank' must be"),
    ({"kv_lora_rank": -512}, "'kv_lora_rank' must be"),
    ({"num_local_experts": -1}, "'num_local_experts' must be"),
    ({"num_local_experts": 10**12}, "'num_local_experts' must be"),
    ({"num_local_experts": 8, "num_experts_per_tok": 0}, "'num_experts_per_tok' must be"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' must be"),
    ({"num_key_value_heads": -8}, "'num_key_value_heads' must be"),
    ({"head_dim": 1e300}, "'head_dim' must be"),
    ({"head_dim": "128"}, "'head_dim' must be"),
    ({"intermediate_size": True}, "'intermediate_size' must be"),
    ({"hidden_size": 16}, "must give head_dim"),  # 32 heads: hidden // heads is 0
])
def test_absurd_model_config_fields_are_one_line_errors(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, fields: dict[str, object],
        needle: str) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, **fields}))
    code, out, err = plan(capsys, "--model", str(cfg))
    assert code == 2 and out == ""
    assert err.startswith("kvtier plan: error:") and len(err.strip().splitlines()) == 1
    assert needle in err


def test_unset_optional_fields_still_plan(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    """null and 0 mean "not set" in real configs (dense Granite: num_local_experts 0)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, "head_dim": None, "q_lora_rank": None,
                               "kv_lora_rank": None, "num_local_experts": 0,
                               "n_shared_experts": 0, "sliding_window": None}))
    doc = plan_json(capsys, "--model", str(cfg))
    assert doc["kv_bytes_per_token"] == plan_json(capsys, "--model", "llama-3-8b")[
        "kv_bytes_per_token"]


@pytest.mark.parametrize(("body", "needle"), [
    ("[" * 100_000, "nested too deeply"),
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ('{"num_hidden_layers": ' + "9" * 5000 + "}", "too long"),
    ("[1, 2, 3]", "JSON object"),
    ('"config"', "JSON object"),
])
def test_hostile_model_json_is_one_line_exit_2(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path, body: str, needle: str) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(body)
    code, out, err = plan(capsys, "--model", str(cfg))
    assert code == 2 and out == ""
    assert err.startswith("kvtier plan: error:") and len(err.strip().splitlines()) == 1
    assert needle in err and str(cfg) in err


def test_live_stats_from_a_fifo_is_refused(tmp_path: Path) -> None:
    """A FIFO without a writer blocked for ever (/dev/zero, which grew to 12 GB:
    tests/integration/test_command_line.py): --live-stats reads as kvtier stats and doctor
    do (a regular file, at most 64 MiB)."""
    import threading

    from kvtier.policy.mrc import LiveStatsError, load_stats

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[object] = []

    def read() -> None:
        try:
            got.append(load_stats(str(fifo)))
        except LiveStatsError as exc:
            got.append(exc)

    t = threading.Thread(target=read, daemon=True)   # the old reader never returned
    t.start()
    t.join(timeout=10)
    assert len(got) == 1 and "not a regular file" in str(got[0]), got


def test_live_stats_from_a_slow_server_ends_at_the_deadline() -> None:
    """A server dripping a byte every 0.1 s kept the per-read timeout from ever firing."""
    import socket
    import threading
    import time

    from kvtier.policy.mrc import LiveStatsError, load_stats

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    stop = threading.Event()

    def drip() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
            while not stop.is_set():
                try:
                    conn.sendall(b" ")
                except OSError:
                    return
                time.sleep(0.1)

    threading.Thread(target=drip, daemon=True).start()
    got: list[object] = []

    def read() -> None:
        try:
            got.append(load_stats(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout=1.0))
        except LiveStatsError as exc:
            got.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=10)
    stop.set()
    srv.close()
    assert len(got) == 1 and isinstance(got[0], LiveStatsError), got
    assert "too slow" in str(got[0])


def test_live_stats_with_a_number_too_large_is_exit_2(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text('{"policy": {"tiers": {"cpu": {"mrc": [{"scale": 1, "hit_rate": 1'
                 + "0" * 400 + "}]}}}}")
    code, _out, err = plan(capsys, "--model", "llama-2-7b", "--live-stats", str(p))
    assert code == 2 and "too large" in err and "Traceback" not in err
