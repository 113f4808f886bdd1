"""Multi-turn chat on CPU vLLM: time to first token and prefill work, with kvtier vs without.

Each conversation's turn ``t`` prompt is the previous prompt + the previous answer + new
user tokens, so every turn repeats a long prefix. The model (random Llama: 4 layers,
hidden 512, 8 heads, head_dim 64, no download) is big enough that prefill dominates.
vLLM's own prefix cache is off in both runs, so the difference is what kvtier brings.
Both engines run in this invocation (one subprocess each, one after the other, sharing the
machine), and a kvtier daemon is started for the kvtier run.

    .venv/bin/python benchmarks/bench_vllm_multiturn.py [--conversations 3 --turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1000
ANSWER_TOKENS = 32


def build_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=8192, initializer_range=0.3,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def conversations(n: int, turns: int, first: int, user: int) -> list[list[list[int]]]:
    """Per conversation, per turn, the new tokens (user message; answers come from the
    model)."""
    rng = random.Random(7)
    return [[[rng.randrange(1, VOCAB) for _ in range(first if t == 0 else user)]
             for t in range(turns)] for _ in range(n)]


def engine_run(model: str, socket: str | None, convs: list[list[list[int]]],
               out: str) -> None:
    """Child process: run every conversation turn by turn; record TTFT and prefill."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if socket:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"socket_path": socket, "tokens_per_block": 256})
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
              enforce_eager=True, enable_prefix_caching=False, max_model_len=8192, seed=0,
              **kwargs)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    answer = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], first, use_tqdm=False)  # warm-up
    rows = []
    for c, turns in enumerate(convs):
        prompt: list[int] = []
        for t, user in enumerate(turns):
            prompt = prompt + user
            t0 = time.perf_counter()
            (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], first, use_tqdm=False)
            ttft = time.perf_counter() - t0
            cached = int(o.num_cached_tokens or 0)
            (a,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], answer,
                                use_tqdm=False)
            rows.append({"conv": c, "turn": t, "prompt": len(prompt), "ttft_s": ttft,
                         "prefill": len(prompt) - cached, "first_token": o.outputs[0].token_ids[0],
                         "answer": list(a.outputs[0].token_ids)})
            prompt = prompt + list(a.outputs[0].token_ids)
    Path(out).write_text(json.dumps(rows))
    llm.llm_engine.engine_core.shutdown(timeout=30)
    os._exit(0)


def spawn(model: Path, socket: str | None, convs: Any, work: Path, name: str) -> list[dict]:
    spec = work / f"{name}.convs.json"
    spec.write_text(json.dumps(convs))
    out = work / f"{name}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": str(REPO)}
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, __file__, "--child", str(model), socket or "",
                        str(spec), str(out)], env=env, stdout=log, stderr=log, check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=2048)
    ap.add_argument("--user-tokens", type=int, default=512)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        model, socket, spec, out = a.child
        engine_run(model, socket or None, json.loads(Path(spec).read_text()), out)
        return
    sys.path.insert(0, str(REPO))
    from tests.support.daemon import DaemonProcess

    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    model = work / "model"
    build_model(model)
    convs = conversations(a.conversations, a.turns, a.first_tokens, a.user_tokens)
    base = spawn(model, None, convs, work, "baseline")
    daemon = DaemonProcess(work / "daemon", cpu_bytes="2GiB", nvme_bytes="0").start()
    try:
        kv = spawn(model, str(daemon.socket), convs, work, "kvtier")
    finally:
        daemon.kill()
    report(base, kv)


def report(base: list[dict], kv: list[dict]) -> None:
    print(f"{'conv':>4} {'turn':>4} {'prompt':>6} | {'TTFT base':>9} {'TTFT kvtier':>11} "
          f"{'ratio':>6} | {'prefill base':>12} {'prefill kvtier':>14} | same tokens")
    for b, k in zip(base, kv, strict=True):
        same = b["first_token"] == k["first_token"] and b["answer"] == k["answer"]
        print(f"{b['conv']:>4} {b['turn']:>4} {b['prompt']:>6} | {b['ttft_s'] * 1e3:>7.1f}ms "
              f"{k['ttft_s'] * 1e3:>9.1f}ms {b['ttft_s'] / k['ttft_s']:>5.2f}x | "
              f"{b['prefill']:>12} {k['prefill']:>14} | {same}")
    later = [(b, k) for b, k in zip(base, kv, strict=True) if b["turn"] > 0]
    tb = sum(b["ttft_s"] for b, _ in later)
    tk = sum(k["ttft_s"] for _, k in later)
    pb = sum(b["prefill"] for b, _ in later)
    pk = sum(k["prefill"] for _, k in later)
    print(f"turns >= 2: TTFT {tb * 1e3:.0f}ms -> {tk * 1e3:.0f}ms ({tb / tk:.2f}x faster); "
          f"prefill tokens {pb} -> {pk} ({pb / max(pk, 1):.1f}x fewer)")


if __name__ == "__main__":
    main()
