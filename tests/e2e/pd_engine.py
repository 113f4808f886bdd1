"""One engine of a prefill/decode pair, in its own process (the P/D tests and bench_pd).

``python tests/e2e/pd_engine.py SPEC.json OUT.json`` builds one vLLM engine (CPU) with the
spec's ``kv_transfer_config``, generates the spec's prompts one request at a time (so each
request's wall time is its own), and right after each request returns asks ``probe_url``
(a daemon's ``POST /v1/prefix``, typically the *other* node's) how many leading blocks of
the prompt the shared Redis holds: a producer's blocks must be visible there by the time its
request is reported finished. Writes per prompt ``[tokens, num_cached_tokens, seconds,
redis_blocks]`` (``redis_blocks`` -1 without a probe) and the connector's counters.

Spec: ``model``, ``transfer`` (or null), ``prompts``, ``max_tokens``, ``probe_url``,
``probe_layout`` (the engine's KVLayout as a dict, so the probe names the namespace
without an engine on the probed node), ``warmup`` (prompts run first, not reported),
``gate`` (optional ``{"after": N, "dir": PATH}``: after N prompts, create PATH/paused and
wait for PATH/go, so a test can break something while the engine is up mid-run).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.vllm_engine import connector_counters, engine_model_id, generate, make_llm


def probe(url: str, model_id: str, layout: dict[str, Any], tokens: list[int]) -> int:
    body = json.dumps({"model_id": model_id, "layout": layout, "token_ids": tokens}).encode()
    req = urllib.request.Request(url + "/v1/prefix", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    for _ in range(20):   # "timeout" means the probe could not tell: ask again
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.loads(r.read())
        if answer["redis"] != "timeout":
            break
    return int(answer["redis_blocks"])


GATE_WAIT_S = 120.0


def wait_at_gate(gate: dict[str, Any]) -> None:
    """Tell the test the engine is paused mid-run and wait until it says go."""
    where = Path(gate["dir"])
    (where / "paused").touch()
    deadline = time.monotonic() + GATE_WAIT_S
    while not (where / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"pd_engine: no {where / 'go'} within {GATE_WAIT_S:.0f} s")
        time.sleep(0.02)


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    model = Path(spec["model"])
    llm = make_llm(model, spec.get("transfer"), spec.get("prefix_caching", False))
    max_tokens = int(spec.get("max_tokens", 12))
    for p in spec.get("warmup", []):
        generate(llm, [p], max_tokens=1)
    rows: list[list[Any]] = []
    gate = spec.get("gate")
    for i, p in enumerate(spec["prompts"]):
        if gate is not None and i == int(gate["after"]):
            wait_at_gate(gate)
        t0 = time.perf_counter()
        ((tokens, cached),) = generate(llm, [p], max_tokens=max_tokens)
        took = time.perf_counter() - t0
        seen = -1
        if spec.get("probe_url"):
            # the full model id: no engine registered it on the probed node yet
            seen = probe(spec["probe_url"], engine_model_id(str(model), model),
                         spec["probe_layout"], p)
        rows.append([tokens, cached, took, seen])
    Path(out_path).write_text(json.dumps(rows))
    Path(out_path + ".connector.json").write_text(json.dumps(connector_counters(llm)))
    llm.llm_engine.engine_core.shutdown(timeout=30)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
