"""Run tiny random models of many Hugging Face architectures through CPU vLLM with kvtier.

The connector reads only the engine's KV cache spec, never the model class, so any
architecture whose KV cache vLLM gives one full-attention group should save and reload
exactly. This checks that claim beyond the geometries the e2e tests pin: per architecture
a random checkpoint (no download), a baseline engine without kvtier, an engine that saves
through a fresh daemon, and a fresh engine that loads. It passes when the three engines'
greedy tokens agree and the loading engine reports every full kvtier block of each prompt
as cached; an architecture the connector refuses by design (``REFUSED``) must fail at
start with the connector's ``ConfigError``. Exit status 1 on any other outcome.

    .venv/bin/python scripts/vllm_architectures.py [--arch qwen2 gpt2 ...] [--dtype bfloat16]

About 40 s per architecture on a 2-core machine. head_dim is 32 or more throughout: vLLM's
CPU attention refuses 16.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.vllm_engine import (  # noqa: E402
    TOKENS_PER_BLOCK,
    VOCAB,
    kv_transfer_config,
    prompt,
)
from tests.support.daemon import DaemonProcess  # noqa: E402

RUNNER = REPO / "tests" / "e2e" / "vllm_engine.py"
PROMPTS = [prompt(1, 300), prompt(2, 200)]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
# hidden 128 over 4 heads: head_dim 32, the CPU backend's smallest
LLAMA_LIKE = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4,
              "max_position_embeddings": 4096, "initializer_range": 0.3}


def _model(cls: str, cfg: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        import transformers

        return getattr(transformers, cls)(getattr(transformers, cfg)(**kw))
    return make


ARCHITECTURES: dict[str, Callable[[], Any]] = {
    # GQA, attention biases
    "qwen2": _model("Qwen2ForCausalLM", "Qwen2Config", **LLAMA_LIKE, num_key_value_heads=2,
                    tie_word_embeddings=False),
    # q/k norms, one KV head of head_dim 48 (not hidden / heads)
    "qwen3": _model("Qwen3ForCausalLM", "Qwen3Config", **LLAMA_LIKE, num_key_value_heads=1,
                    head_dim=48, tie_word_embeddings=False),
    "mistral": _model("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE,
                      num_key_value_heads=2, sliding_window=None),
    # every layer a 64-token sliding window: a SlidingWindowSpec, refused (docs)
    "mistral-swa": _model("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE,
                          num_key_value_heads=2, sliding_window=64),
    # the same with vLLM's --disable-sliding-window (ENGINE_ARGS): full attention, served
    "mistral-swa-off": _model("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE,
                              num_key_value_heads=2, sliding_window=512),
    # alternating sliding and full layers, logit soft-capping
    "gemma2": _model("Gemma2ForCausalLM", "Gemma2Config", **LLAMA_LIKE, num_key_value_heads=2,
                     head_dim=32, sliding_window=64, query_pre_attn_scalar=32),
    # fused qkv, no GQA
    "phi3": _model("Phi3ForCausalLM", "Phi3Config", **LLAMA_LIKE, num_key_value_heads=4,
                   pad_token_id=0),
    # learned absolute positions, biases, no RoPE
    "gpt2": _model("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=128, n_layer=2,
                   n_head=4, n_positions=4096, bos_token_id=1, eos_token_id=2),
    "opt": _model("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=128,
                  ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=4096, word_embed_proj_dim=128),
    # partial rotary (a quarter of each head)
    "gptneox": _model("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=VOCAB,
                      hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=4096, rotary_pct=0.25),
    # mixture of experts in every layer
    "qwen3moe": _model("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **LLAMA_LIKE,
                       num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
    # attention and residual multipliers
    "granite": _model("GraniteForCausalLM", "GraniteConfig", **LLAMA_LIKE,
                      num_key_value_heads=2),
    # post-norms, q/k norms over all heads
    "olmo2": _model("Olmo2ForCausalLM", "Olmo2Config", **LLAMA_LIKE, num_key_value_heads=2),
}
REFUSED = {"mistral-swa": "--disable-sliding-window"}
"""Architectures the connector refuses at start, and what its ConfigError names."""
ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "mistral-swa-off": {"disable_sliding_window": True, "max_model_len": 512}}
"""More engine arguments (``make_llm``) for an architecture, the same for all three
engines: vLLM caps ``max_model_len`` at the window it disables."""


def build(name: str, path: Path) -> Path:
    import torch

    torch.manual_seed(0)
    ARCHITECTURES[name]().save_pretrained(path, safe_serialization=True)
    return path


def engine(work: Path, model: Path, transfer: dict[str, Any] | None, dtype: str,
           engine_args: dict[str, Any] | None) -> tuple[list[list[Any]] | None,
                                                        dict[str, Any], str]:
    """One engine process over PROMPTS: (outputs, connector counters, log); outputs None
    when the engine failed."""
    work.mkdir()
    spec, out, log = work / "spec.json", work / "out.json", work / "engine.log"
    spec.write_text(json.dumps({"model": str(model), "transfer": transfer, "dtype": dtype,
                                "engine_args": engine_args,
                                "phases": [{"prompts": PROMPTS}]}))
    with open(log, "w") as fh:
        rc = subprocess.run([sys.executable, str(RUNNER), str(spec), str(out)],
                            env={**os.environ, **ENV}, stdout=fh, stderr=fh,
                            timeout=900).returncode
    if rc != 0:
        return None, {}, log.read_text(errors="replace")
    counters = json.loads(Path(str(out) + ".connector.json").read_text())
    return json.loads(out.read_text())[0], counters, ""


def check(name: str, work: Path, dtype: str) -> tuple[bool, str]:
    """(passed, what was seen) for one architecture."""
    model = build(name, work / "model")
    args = ENGINE_ARGS.get(name)
    base, _, log = engine(work / "base", model, None, dtype, args)
    if base is None:
        return False, "the engine without kvtier failed: " + last_error(log)
    daemon = DaemonProcess(work / "daemon").start()
    try:
        transfer = kv_transfer_config(daemon.socket)
        saved, saves, log = engine(work / "save", model, transfer, dtype, args)
        if saved is None:
            word = REFUSED.get(name)
            if word and "ConfigError" in log and word in log:
                return True, f"refused at start as documented ({word})"
            return False, "the saving engine failed: " + last_error(log)
        loaded, loads, log = engine(work / "load", model, transfer, dtype, args)
    finally:
        daemon.kill()
    if name in REFUSED:
        return False, "served, though the connector should refuse it"
    if loaded is None:
        return False, "the loading engine failed: " + last_error(log)
    tokens = [[o[0] for o in run] for run in (base, saved, loaded)]
    cached = [o[1] for o in loaded]
    want = [len(p) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK for p in PROMPTS]
    seen = (f"saved {saves.get('saved_blocks')} blocks, loaded {loads.get('loaded_blocks')}; "
            f"cached tokens {cached} (full blocks {want})")
    if not tokens[0] == tokens[1] == tokens[2]:
        return False, "tokens differ from the engine without kvtier; " + seen
    return cached == want, seen


def last_error(log: str) -> str:
    lines = [ln for ln in log.splitlines() if "Error" in ln]
    return lines[-1].strip()[:300] if lines else "(no error line; see the engine log)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="+", choices=sorted(ARCHITECTURES),
                    default=list(ARCHITECTURES))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-archs-"))
    failed = []
    for name in a.arch:
        t0 = time.monotonic()
        try:
            ok, seen = check(name, root / name, a.dtype)
        except Exception as e:   # one architecture's setup failing must not hide the rest
            ok, seen = False, f"{type(e).__name__}: {e}"
        print(f"{name:<16} {'ok  ' if ok else 'FAIL'} {seen} ({time.monotonic() - t0:.0f} s)",
              flush=True)
        if not ok:
            failed.append(name)
    print(f"{len(a.arch) - len(failed)} of {len(a.arch)} as expected ({a.dtype})"
          + (f"; failed: {' '.join(failed)}; logs in {root}" if failed else ""))
    if not failed and not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
