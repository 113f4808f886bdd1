"""One scenario of a kvtier load that fails while vLLM's own prefix cache is on (an
in-process engine driven step by step), run in a fresh process:
``python failed_load_engine.py SCENARIO MODEL SOCKET OUT.json``.

Every scenario computes a 300-token prompt once (saved to kvtier), empties vLLM's prefix
cache, then has the next load of that prompt lose kvtier blocks 1-3 after its lookup:
vLLM keeps the pages that failed to load in its prefix cache (``recompute`` policy) for
the request it rolls back, and

- ``abort``: that request is aborted before it recomputes them, and the prompt is sent
  again (a client's retry);
- ``duplicate``: the same prompt arrives the step after, while the first recomputes them
  64 tokens a step (``long_prefill_token_threshold``);
- ``preempt``: a small KV cache: vLLM preempts the request before it recomputes them, and
  it resumes on its own failed pages.

OUT.json: {"want": {request: the tokens computed from scratch}, "got": {request: [tokens,
cached]}}. With ASYNC_SCHEDULING=1 the engine runs vLLM's async scheduling (its default on
GPUs, which its CPU platform turns off): step N+1 is scheduled before step N's output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.vllm_engine import (
    ENGINE_ENV,
    generate,
    kv_transfer_config,
    lose_blocks_at_load,
    make_llm,
    prompt,
)

ENGINE_ARGS = {
    "abort": {},
    "duplicate": {"enable_chunked_prefill": True, "max_num_batched_tokens": 512,
                  "long_prefill_token_threshold": 64},
    "preempt": {"num_gpu_blocks_override": 14, "max_model_len": 320},
}


def _async_scheduling() -> None:
    """Turn vLLM's async scheduling back on after its CPU platform turned it off."""
    from vllm.platforms.cpu import CpuPlatform

    checked = CpuPlatform.check_and_update_config.__func__   # type: ignore[attr-defined]

    def check(cls: Any, vllm_config: Any) -> None:
        checked(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check)  # type: ignore[method-assign,assignment]


def _drain(engine: Any) -> dict[str, list[Any]]:
    done: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(out.outputs[0].token_ids),
                                        int(out.num_cached_tokens or 0)]
    return done


def main(scenario: str, model: str, socket: str, out: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(Path(model), kv_transfer_config(socket, model_id=f"failed-{scenario}"),
                   prefix_caching=True, engine_args=ENGINE_ARGS[scenario])
    p, other = prompt(4711, 300), prompt(4712, 95)
    ((want, _),) = generate(llm, [p])                    # computed, saved to kvtier
    ((want_other, _),) = generate(llm, [other])
    for _ in range(50):   # steps until the delayed frees are reported and the cache empties
        generate(llm, [prompt(1, 10)], max_tokens=1)
        if llm.reset_prefix_cache():
            break
        time.sleep(0.1)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got: dict[str, list[Any]] = {}
    if scenario == "preempt":
        engine.add_request("other", TokensPrompt(prompt_token_ids=other), params)
        engine.step()                                    # its prefill: 3 of 14 pages
    lose_blocks_at_load([1, 4])
    engine.add_request("r1", TokensPrompt(prompt_token_ids=p), params)
    engine.step()                                        # r1's load of blocks 1-3 fails
    if scenario == "abort":
        engine.abort_request(["r1"])
        for _ in range(3):
            engine.step()
        ((tokens, cached),) = generate(llm, [p])
        got["again"] = [tokens, cached]
    elif scenario == "duplicate":
        engine.add_request("r2", TokensPrompt(prompt_token_ids=p), params)
    got.update(_drain(engine))
    wants = {name: want_other if name == "other" else want for name in got}
    out.write_text(json.dumps({"want": wants, "got": got}))


if __name__ == "__main__":
    os.environ.update(ENGINE_ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if os.environ.get("ASYNC_SCHEDULING") == "1":
        _async_scheduling()
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    sys.stdout.flush()
    os._exit(0)   # (vLLM's in-process engine may hang at interpreter exit)
