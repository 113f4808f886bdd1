"""An in-process engine whose weights are replaced in place, as an RL trainer's update does
(``python weights_update_engine.py MODEL NEW_MODEL SOCKET OUT.json``): a prompt computed
with the old weights (saved to kvtier), the embeddings overwritten with those of
NEW_MODEL, vLLM's cache-reset cascade (``reset_prefix_cache(reset_running_requests=True,
reset_connector=True)``), then the prompt under a fresh ``cache_salt`` (computed with the
new weights) and under none (where kvtier holds the old weights' KV).

OUT.json: {"old": tokens, "want": tokens, "got": tokens, "cached": num_cached_tokens}.
(vLLM's CPU backend repacks linear weights after loading, so ``load_weights`` cannot run
again here; new embeddings stand in for an update.)"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.vllm_engine import ENGINE_ENV, generate, kv_transfer_config, make_llm, prompt


def main(model: Path, new: Path, socket: str, out: Path) -> None:
    import torch
    from safetensors.torch import load_file

    llm = make_llm(model, kv_transfer_config(socket, model_id="rl-policy"), prefix_caching=True)
    p = prompt(99, 300)
    ((old, _),) = generate(llm, [p])                    # old weights, saved to kvtier
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    emb = runner.model.model.embed_tokens.weight
    with torch.no_grad():
        w = load_file(new / "model.safetensors")["model.embed_tokens.weight"].to(emb.dtype)
        emb[: w.shape[0]].copy_(w)
    for _ in range(50):   # steps until the delayed frees are reported, then the reset cascade
        generate(llm, [prompt(1, 10)], max_tokens=1)
        if llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the engine's cache could not be reset")
    ((want, _),) = generate(llm, [p], salts=["never-seen"])   # new weights, computed
    ((got, cached),) = generate(llm, [p])
    out.write_text(json.dumps({"old": old, "want": want, "got": got, "cached": cached}))


if __name__ == "__main__":
    os.environ.update(ENGINE_ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    sys.stdout.flush()
    os._exit(0)   # (vLLM's in-process engine may hang at interpreter exit)
