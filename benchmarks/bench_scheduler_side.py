"""The vLLM connector's scheduler-side cost per engine step, against vLLM's own per-step
Python work for the same requests, side by side in one run.

The scheduler side runs in vLLM's scheduler loop, between GPU steps: what it costs a step
adds to every request's inter-token latency once the GPU waits on the scheduler. This
measures, for N running requests of ``--prompt`` tokens (16-token pages, 256-token kvtier
blocks, no daemon: plans only):

- ``decode step``: ``build_connector_meta`` for a step in which every request decodes one
  token (most complete no block);
- ``admit a load``: ``update_state_after_alloc`` of one more request whose prefix kvtier
  holds, with N live requests that loaded theirs (a P/D consumer loads for every request);

each against building vLLM's own ``SchedulerOutput`` for that step (its
``CachedRequestData`` of N requests and their token counts), a lower bound of what vLLM's
scheduler itself does per step in Python. Medians of ``--steps`` steps.

Usage: python benchmarks/bench_scheduler_side.py [--requests 64,256,1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

PAGE, TPB = 16, 256


def _request(i: int, prompt: int) -> Any:
    return SimpleNamespace(request_id=f"r{i}", all_token_ids=list(range(prompt)),
                           num_prompt_tokens=prompt, num_tokens=prompt, cache_salt=None,
                           mm_features=None, prompt_embeds=None, lora_request=None)


def _vllm_output(reqs: list[Any]) -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    ids = [r.request_id for r in reqs]
    n = len(ids)
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(
            ids, set(), [], {}, [None] * n, [len(r.all_token_ids) - 1 for r in reqs], [0] * n),
        num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=n,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[])


def run(n: int, prompt: int, steps: int, socket_dir: Path) -> tuple[float, float, float]:
    """(vLLM's output ms, decode step ms, admit-a-load ms) medians for ``n`` requests."""
    from kvtier.connectors.vllm.config import ConnectorConfig
    from kvtier.connectors.vllm.mapping import LoadSpan
    from kvtier.connectors.vllm.scheduler import SchedulerSide

    from kvtier.layout import KVLayout

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                      tokens_per_block=TPB)
    cfg = ConnectorConfig.from_extra({"socket_path": str(socket_dir / "none.sock"),
                                      "tokens_per_block": TPB, "model_id": "m"},
                                     block_size=PAGE, default_model_id="m")
    sched = SchedulerSide(cfg, layout, PAGE, 1)
    pages_per_req = -(-prompt // PAGE) + 1
    blocks = (prompt - 1) // TPB

    def admit(i: int) -> float:
        req = _request(i, prompt)
        pages = list(range(1 + i * pages_per_req, 1 + (i + 1) * pages_per_req))  # (0: null)
        sched._spans[req.request_id] = LoadSpan(0, blocks, 0, blocks * TPB)
        blocks_of = SimpleNamespace(get_block_ids=lambda: (pages,))   # vLLM's KVCacheBlocks
        t0 = time.perf_counter()
        sched.update_state_after_alloc(req, blocks_of, blocks * TPB)  # type: ignore[arg-type]
        return time.perf_counter() - t0

    try:
        for i in range(n):
            admit(i)
        reqs = [sched._states[f"r{i}"].request for i in range(n)]
        sched.build_connector_meta(_vllm_output(reqs))   # the loads planned: taken
        vllm_s, step_s, admit_s = [], [], []
        for k in range(steps):
            for r in reqs:
                r.all_token_ids.append(7)
            t0 = time.perf_counter()
            out = _vllm_output(reqs)
            vllm_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sched.build_connector_meta(out)
            step_s.append(time.perf_counter() - t0)
            if k < 50:   # one more admitted load, then it finishes (N stays N)
                admit_s.append(admit(n + k))
                sched.request_finished(_request(n + k, prompt))
        return (statistics.median(vllm_s) * 1e3, statistics.median(step_s) * 1e3,
                statistics.median(admit_s) * 1e3)
    finally:
        sched.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="64,256,1024")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.requests.split(",")]
    np.random.seed(0)
    print(f"scheduler side per step, {args.prompt}-token prompts, {PAGE}-token pages, "
          f"{TPB}-token blocks; medians of {args.steps} steps (ms)")
    print("vLLM output: building vLLM's SchedulerOutput of the step (a lower bound of its "
          "own per-step work); x vLLM: kvtier's time / that")
    print(f"{'requests':>8} {'vLLM output':>12} {'decode step':>12} {'x vLLM':>7} "
          f"{'admit a load':>13} {'x vLLM':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            base, step, admit = run(n, args.prompt, args.steps, Path(tmp))
            print(f"{n:>8} {base:>12.3f} {step:>12.3f} {step / base:>7.2f} "
                  f"{admit:>13.3f} {admit / base:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
