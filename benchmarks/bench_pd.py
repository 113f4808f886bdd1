"""Prefill/decode through kvtier on the CPU engine: the consumer's TTFT with the prompt's KV
loaded from Redis against recomputing it, side by side in one run.

Two real daemons (node A, node B; separate data directories and arenas, no nvme) share one
real redis-server (``--cluster``: a 3-master Redis Cluster). A producer vLLM engine
(``kv_role: kv_producer``) on node A prefills ``--prompts`` prompts of ``--tokens`` tokens
(one output token each, as a P/D proxy asks; every prompt block is in Redis when each
request returns). Then one consumer engine (``kv_consumer``) on node B, whose own tiers are
cold, serves alternately a prompt the producer prefilled (its KV comes from Redis) and a
fresh prompt of the same length (recomputed), one request at a time with one output token:
each request's wall time is its TTFT. It prints the median TTFT of each kind, their ratio,
the tokens the consumer took from kvtier, and the producer's per-request time.

The model is a random Llama built here (no download); ``--layers``/``--hidden`` size it so
that prefill costs something on a CPU.

Usage: python benchmarks/bench_pd.py [--prompts 6] [--tokens 2048] [--layers 4]
       [--hidden 256] [--cluster]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.connectors.vllm.geometry import with_engine_page_format

from kvtier.layout import KVLayout
from tests.e2e.vllm_engine import ENGINE_ENV
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import running_cluster, running_server

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "e2e" / "pd_engine.py"
BLOCK_SIZE = 32
TOKENS_PER_BLOCK = 256
VOCAB = 4000


def build_model(path: Path, layers: int, hidden: int) -> KVLayout:
    """A random LlamaForCausalLM; returns the KV layout of one kvtier block."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, head_dim = hidden // 64, 64
    kv_heads = max(1, heads // 2)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=16384, initializer_range=0.3,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    # the page format of the CPU engine's attention kernel is in its namespace
    return with_engine_page_format(
        KVLayout(layers, kv_heads, head_dim, "float32", TOKENS_PER_BLOCK), None, BLOCK_SIZE)


def transfer(node: DaemonProcess, role: str) -> dict[str, Any]:
    return {"kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket_path": str(node.socket),
                                          "tokens_per_block": TOKENS_PER_BLOCK,
                                          "timeout_s": 10.0, "redis_sync_timeout_s": 8.0,
                                          "skip_slower_than_recompute": False}}


def run_engine(work: Path, spec: dict[str, Any]) -> tuple[list[list[Any]], dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out = work / "spec.json", work / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(out)], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    (work / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0 or not out.exists():
        sys.exit(f"engine failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    counters = json.loads(Path(str(out) + ".connector.json").read_text())
    return json.loads(out.read_text()), counters


@contextlib.contextmanager
def redis_url(root: Path, cluster: bool) -> Iterator[str]:
    if cluster:
        with running_cluster(root / "cluster", 3) as c:
            yield c.url
    else:
        with running_server(root / "redis") as s:
            yield s.url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster")
    args = ap.parse_args()
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(args.tokens)]

    prefilled = [fresh() for _ in range(args.prompts)]
    recomputed = [fresh() for _ in range(args.prompts)]
    warmup = [fresh()[:600] for _ in range(2)]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-pd-") as tmp:
        root = Path(tmp)
        layout = build_model(root / "model", args.layers, args.hidden)
        with redis_url(root, args.cluster) as url, contextlib.ExitStack() as stack:
            nodes = []
            for name in ("a", "b"):
                d = DaemonProcess(root / f"node-{name}", cpu_bytes="1GiB", nvme_bytes="0",
                                  extra_args=["--redis-url", url],
                                  env={"KVTIER_REDIS_WRITE_THROUGH": "false",
                                       "KVTIER_REDIS_LOOKUP_BUDGET_S": "2.0"})
                stack.callback(d.kill)
                nodes.append(d.start())
            node_a, node_b = nodes
            common = {"model": str(root / "model"), "max_tokens": 1,
                      "probe_layout": layout.to_dict()}
            prod, _ = run_engine(root / "producer", {
                **common, "transfer": transfer(node_a, "kv_producer"), "prompts": prefilled,
                "warmup": warmup, "probe_url": node_b.http_url})
            blocks = args.tokens // TOKENS_PER_BLOCK
            visible = [row[3] for row in prod]
            order = [p for pair in zip(prefilled, recomputed, strict=True) for p in pair]
            cons, counters = run_engine(root / "consumer", {
                **common, "transfer": transfer(node_b, "kv_consumer"), "prompts": order,
                "warmup": warmup})
            redis_stats = node_b.stats()["tiers"].get("redis", {})
            synced = node_a.stats()["daemon"]["redis_sync"]
    from_redis = cons[0::2]
    recompute = cons[1::2]
    t_redis = statistics.median(r[2] for r in from_redis)
    t_recompute = statistics.median(r[2] for r in recompute)
    kv_mib = layout.block_bytes * blocks / 2**20
    print(f"P/D on the CPU engine: {args.prompts} prompts of {args.tokens} tokens, Llama "
          f"{args.layers} layers x {args.hidden} hidden (random weights), KV {kv_mib:.1f} "
          f"MiB per prompt, Redis {'Cluster (3 masters)' if args.cluster else 'server'}")
    t_prod = statistics.median(r[2] for r in prod)
    print(f"  producer (node A): median {t_prod * 1e3:8.1f} ms per prefill incl. "
          f"synchronous write-through ({t_prod / statistics.median(r[2] for r in cons[1::2]):.2f}"
          f"x the consumer's plain recompute); blocks in Redis at request end: {visible} of "
          f"{blocks} each")
    if synced["commits"]:
        print(f"  producer's synchronous commits (node A): {synced['commits']}, "
              f"{synced['seconds'] / synced['commits'] * 1e3:.1f} ms each on average "
              f"(answered once the chain is in Redis), gave up {synced['gave_up']}")
    print(f"  consumer (node B) TTFT, KV from Redis: median {t_redis * 1e3:8.1f} ms  "
          f"(num_cached_tokens {[r[1] for r in from_redis]})")
    print(f"  consumer (node B) TTFT, recomputed:    median {t_recompute * 1e3:8.1f} ms  "
          f"(num_cached_tokens {[r[1] for r in recompute]})")
    print(f"  ratio from Redis / recompute: {t_redis / t_recompute:.2f}   "
          f"(node B's Redis tier: hit_blocks {redis_stats.get('hit_blocks')}, "
          f"bytes_read {redis_stats.get('bytes_read')})")
    if counters:
        print(f"  consumer connector counters: {counters}")


if __name__ == "__main__":
    main()
