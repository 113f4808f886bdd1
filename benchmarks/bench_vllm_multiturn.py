"""Multi-turn chat on CPU vLLM: time to first token and prefill work, with kvtier vs without.

Each conversation's turn ``t`` prompt is the previous prompt + the previous answer + new
user tokens, so every turn repeats a long prefix. The model (random Llama: 4 layers,
hidden 512, 8 heads, head_dim 64, no download; ``--model mla`` or ``swa`` for DeepSeek-V2's
latent attention or Gemma 3's sliding windows) is big enough that prefill dominates.
vLLM's own prefix cache is off in both runs, so the difference is what kvtier brings.
Both engines run in this invocation (one subprocess each, one after the other, sharing the
machine), and a kvtier daemon is started for the kvtier run.

Two modes per engine, both printed: *sequential* (one conversation at a time, TTFT of each
turn: first turns are all misses, later turns hit) and *concurrent* (``--concurrent N``
other conversations at once, each turn of all of them submitted together so vLLM batches
them continuously; output tokens per second per turn: turn 1 hits nothing, later turns hit
their prefixes).

Both engines run with tcmalloc preloaded when it is installed (vLLM's CPU setup; Debian
``libtcmalloc-minimal4``), ``--malloc glibc`` to compare with glibc's malloc.

    .venv/bin/python benchmarks/bench_vllm_multiturn.py [--conversations 3 --turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1000
ANSWER_TOKENS = 32


MODELS = ("llama", "mla", "swa")


def build_model(path: Path, kind: str = "llama") -> None:
    """A random model big enough that prefill dominates (4 layers, hidden 512, 8 heads):
    ``llama`` (head_dim 64, K and V), ``mla`` (DeepSeek-V2 attention: one 576-wide latent
    per token, v_head_dim 512, the CPU MLA kernels' geometry) or ``swa`` (Gemma 3: three
    layers of a 512-token sliding window, one of full attention)."""
    import torch
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    common: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 512,
                              "intermediate_size": 1408, "num_hidden_layers": 4,
                              "num_attention_heads": 8, "max_position_embeddings": 8192,
                              "initializer_range": 0.3, "tie_word_embeddings": False}
    torch.manual_seed(0)
    if kind == "mla":
        DeepseekV2ForCausalLM(DeepseekV2Config(
            **common, num_key_value_heads=8, moe_intermediate_size=128, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=4,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=512,
            qk_nope_head_dim=64)).save_pretrained(path, safe_serialization=True)
    elif kind == "swa":
        Gemma3ForCausalLM(Gemma3TextConfig(
            **common, num_key_value_heads=8, head_dim=64, query_pre_attn_scalar=64,
            sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        )).save_pretrained(path, safe_serialization=True)
    else:
        LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=8, head_dim=64)
                         ).save_pretrained(path, safe_serialization=True)


def conversations(n: int, turns: int, first: int, user: int,
                  seed: int = 7) -> list[list[list[int]]]:
    """Per conversation, per turn, the new tokens (user message; answers come from the
    model)."""
    rng = random.Random(seed)
    return [[[rng.randrange(1, VOCAB) for _ in range(first if t == 0 else user)]
             for t in range(turns)] for _ in range(n)]


def engine_run(model: str, socket: str | None, spec: dict[str, Any], out: str) -> None:
    """Child process: run every conversation turn by turn (TTFT and prefill), then the
    concurrent conversations (tokens/s per turn); record the connector's counters."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if socket:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm",
            kv_role=spec.get("kv_role", "kv_both"), kv_load_failure_policy="recompute",
            kv_connector_extra_config={"socket_path": socket, "tokens_per_block": 256})
    # vLLM turns the hybrid KV cache manager off for a connector without HMA support;
    # turn it off for the baseline too, so both engines run the same cache manager.
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
              enforce_eager=True, enable_prefix_caching=False, max_model_len=8192, seed=0,
              disable_hybrid_kv_cache_manager=True, **kwargs)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    answer = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], first, use_tqdm=False)  # warm-up
    together = (concurrent_run(llm, spec["concurrent"], answer)
                if spec.get("concurrent_first") else None)
    rows = []
    convs = spec["sequential"]
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
    if together is None:
        together = concurrent_run(llm, spec["concurrent"], answer)
    Path(out).write_text(json.dumps({"sequential": rows, "concurrent": together,
                                     "connector": connector_counters(llm)}))
    llm.llm_engine.engine_core.shutdown(timeout=30)
    os._exit(0)


def concurrent_run(llm: Any, convs: list[list[list[int]]], answer: Any) -> list[dict]:
    """Each turn of every conversation submitted at once (continuous batching)."""
    from vllm.inputs import TokensPrompt

    prompts: list[list[int]] = [[] for _ in convs]
    rows = []
    for t in range(len(convs[0]) if convs else 0):
        prompts = [p + c[t] for p, c in zip(prompts, convs, strict=True)]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], answer,
                            use_tqdm=False)
        wall = time.perf_counter() - t0
        answers = [list(o.outputs[0].token_ids) for o in outs]
        rows.append({"turn": t, "wall_s": wall, "tokens": sum(len(a) for a in answers),
                     "prompt_tokens": sum(len(p) for p in prompts),
                     "cached": sum(int(o.num_cached_tokens or 0) for o in outs),
                     "answers": answers})
        prompts = [p + a for p, a in zip(prompts, answers, strict=True)]
    return rows


def connector_counters(llm: Any) -> dict[str, float]:
    """The scheduler-side connector's counters (in-process engine core)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    side = getattr(getattr(getattr(core, "scheduler", None), "connector", None),
                   "_scheduler", None)
    if side is None:
        return {}
    return {**side.counters, "prefill_tokens_per_s": round(side.recompute.prefill_tokens_per_s)}


def find_tcmalloc() -> str | None:
    """vLLM's CPU docs preload tcmalloc (vLLM warns without it). glibc's malloc makes a
    prefill's speed depend on the sizes of the prefills before it (its mmap and trim
    thresholds move), so the two engines, which prefill different amounts, would differ
    for a reason that is not kvtier. Debian: libtcmalloc-minimal4."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).exists():
                return str(Path(d) / name)
    return None


def spawn(model: Path, socket: str | None, convs: Any, work: Path, name: str,
          preload: str | None = None) -> dict:
    spec = work / f"{name}.convs.json"
    spec.write_text(json.dumps(convs))
    out = work / f"{name}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": str(REPO)}
    if preload:
        env["LD_PRELOAD"] = preload
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, __file__, "--child", str(model), socket or "",
                        str(spec), str(out)], env=env, stdout=log, stderr=log, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = json.loads(out.read_text())
    run["engine_cpu_s"] = (after.ru_utime + after.ru_stime
                           - before.ru_utime - before.ru_stime)
    return run


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=2048)
    ap.add_argument("--user-tokens", type=int, default=512)
    ap.add_argument("--concurrent", type=int, default=8,
                    help="conversations at once in the concurrent mode (0: skip it)")
    ap.add_argument("--concurrent-turns", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3,
                    help="alternate baseline and kvtier runs this many times (a fresh daemon "
                         "each time) and keep each measurement's best: on a shared machine "
                         "the load changes between runs (one run of each varied by +-4%% per "
                         "first turn here; the default run took ~8 min on a slow 2-core machine)")
    ap.add_argument("--malloc", choices=("tcmalloc", "glibc"), default="tcmalloc",
                    help="the engines' allocator (both runs): tcmalloc, as vLLM's CPU docs "
                         "set it up, when installed; glibc otherwise or when asked")
    ap.add_argument("--model", choices=MODELS, default="llama",
                    help="the random model's attention (build_model): llama, mla "
                         "(DeepSeek-V2 latent) or swa (Gemma 3 sliding windows)")
    ap.add_argument("--kv-role", choices=("kv_both", "kv_consumer"), default="kv_both",
                    help="the kvtier engine's role: kv_consumer looks up and loads but never "
                         "saves, which tells a save's cost from a lookup's")
    ap.add_argument("--concurrent-first", action="store_true",
                    help="run the concurrent mode before the sequential one, so that both "
                         "engines enter it in the same state (after the sequential part the "
                         "engine without kvtier has prefilled ~5x more)")
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
    build_model(model, a.model)
    print(f"model: random {a.model} (build_model)")
    convs = {"sequential": conversations(a.conversations, a.turns, a.first_tokens,
                                         a.user_tokens),
             "concurrent": conversations(a.concurrent, a.concurrent_turns, a.first_tokens,
                                         a.user_tokens, seed=11),
             "kv_role": a.kv_role, "concurrent_first": a.concurrent_first}
    preload = find_tcmalloc() if a.malloc == "tcmalloc" else None
    if "LD_PRELOAD" in os.environ:
        preload = None   # the caller's own choice stands (inherited by both engines)
    print(f"engines' allocator (both runs): "
          f"{preload or os.environ.get('LD_PRELOAD') or 'glibc malloc'}")
    bases, kvs = [], []
    for i in range(a.repeat):
        bases.append(spawn(model, None, convs, work, f"baseline{i}", preload))
        daemon = DaemonProcess(work / f"daemon{i}", cpu_bytes="2GiB", nvme_bytes="0").start()
        try:
            kvs.append(spawn(model, str(daemon.socket), convs, work, f"kvtier{i}", preload))
            assert daemon.proc is not None
            kvs[-1]["daemon_cpu_s"] = process_cpu_s(daemon.proc.pid)
        finally:
            daemon.kill()
    if a.repeat > 1:
        print(f"best of {a.repeat} alternating runs per measurement")
    print("CPU seconds per run (whole engine process; the daemon from its start): "
          + "  ".join(f"baseline {b['engine_cpu_s']:.1f} | kvtier {k['engine_cpu_s']:.1f} "
                      f"+ daemon {k['daemon_cpu_s']:.1f}" for b, k in zip(bases, kvs, strict=True)))
    report(best_of(bases), best_of(kvs))


def best_of(runs: list[dict]) -> dict:
    """Each measurement's best (lowest time) over runs of the same work; tokens must agree."""
    out = json.loads(json.dumps(runs[0]))
    for run in runs[1:]:
        for row, other in zip(out["sequential"], run["sequential"], strict=True):
            assert row["answer"] == other["answer"], "runs disagree on tokens"
            row["ttft_s"] = min(row["ttft_s"], other["ttft_s"])
        for row, other in zip(out["concurrent"], run["concurrent"], strict=True):
            assert row["answers"] == other["answers"], "runs disagree on tokens"
            row["wall_s"] = min(row["wall_s"], other["wall_s"])
    return out


def report(base_run: dict, kv_run: dict) -> None:
    sequential_report(base_run["sequential"], kv_run["sequential"])
    if base_run["concurrent"]:
        concurrent_report(base_run["concurrent"], kv_run["concurrent"])
    counters = kv_run.get("connector") or {}
    if counters:
        print("kvtier connector: " + "  ".join(f"{k} {v:g}" for k, v in sorted(counters.items())))


def sequential_report(base: list[dict], kv: list[dict]) -> None:
    print("sequential: one conversation at a time")
    print(f"{'conv':>4} {'turn':>4} {'prompt':>6} | {'TTFT base':>9} {'TTFT kvtier':>11} "
          f"{'ratio':>6} | {'prefill base':>12} {'prefill kvtier':>14} | same tokens")
    for b, k in zip(base, kv, strict=True):
        same = b["first_token"] == k["first_token"] and b["answer"] == k["answer"]
        print(f"{b['conv']:>4} {b['turn']:>4} {b['prompt']:>6} | {b['ttft_s'] * 1e3:>7.1f}ms "
              f"{k['ttft_s'] * 1e3:>9.1f}ms {b['ttft_s'] / k['ttft_s']:>5.2f}x | "
              f"{b['prefill']:>12} {k['prefill']:>14} | {same}")
    first = [(b, k) for b, k in zip(base, kv, strict=True) if b["turn"] == 0]
    fb = sum(b["ttft_s"] for b, _ in first)
    fk = sum(k["ttft_s"] for _, k in first)
    print(f"first turns (all misses): TTFT {fb * 1e3:.0f}ms -> {fk * 1e3:.0f}ms "
          f"({fb / fk:.2f}x; target >= 0.95x)")
    later = [(b, k) for b, k in zip(base, kv, strict=True) if b["turn"] > 0]
    if not later:   # --turns 1
        return
    tb = sum(b["ttft_s"] for b, _ in later)
    tk = sum(k["ttft_s"] for _, k in later)
    pb = sum(b["prefill"] for b, _ in later)
    pk = sum(k["prefill"] for _, k in later)
    print(f"turns >= 2: TTFT {tb * 1e3:.0f}ms -> {tk * 1e3:.0f}ms ({tb / tk:.2f}x faster); "
          f"prefill tokens {pb} -> {pk} ({pb / max(pk, 1):.1f}x fewer; target >= 3x faster)")


def concurrent_report(base: list[dict], kv: list[dict]) -> None:
    n = len(base[0]["answers"])
    print(f"concurrent: {n} conversations at once (continuous batching)")
    print(f"{'turn':>4} {'prompt tok':>10} | {'tok/s base':>10} {'tok/s kvtier':>12} "
          f"{'ratio':>6} | {'cached kvtier':>13} | same tokens")
    for b, k in zip(base, kv, strict=True):
        rb, rk = b["tokens"] / b["wall_s"], k["tokens"] / k["wall_s"]
        print(f"{b['turn']:>4} {b['prompt_tokens']:>10} | {rb:>10.1f} {rk:>12.1f} "
              f"{rk / rb:>5.2f}x | {k['cached']:>13} | {b['answers'] == k['answers']}")
    b0, k0 = base[0], kv[0]
    print(f"turn 1 (no hits): {b0['tokens'] / b0['wall_s']:.1f} -> "
          f"{k0['tokens'] / k0['wall_s']:.1f} output tok/s "
          f"({(k0['tokens'] / k0['wall_s']) / (b0['tokens'] / b0['wall_s']):.2f}x; "
          f"target >= 0.95x)")
    if len(base) > 1:
        tb = sum(b["tokens"] for b in base[1:]) / sum(b["wall_s"] for b in base[1:])
        tk = sum(k["tokens"] for k in kv[1:]) / sum(k["wall_s"] for k in kv[1:])
        print(f"turns >= 2 (prefix hits): {tb:.1f} -> {tk:.1f} output tok/s "
              f"({tk / tb:.2f}x; target > 1x)")


if __name__ == "__main__":
    main()
