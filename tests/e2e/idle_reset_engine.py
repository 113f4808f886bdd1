"""An in-process engine (as colocated RL trainers run vLLM) resets its cache right after
``generate`` returns, as vLLM's sleep and weight-update flow does first
(``pause_scheduler(mode="abort", clear_cache=True)``):
``python idle_reset_engine.py MODEL SOCKET OUT.json``. OUT.json: {"ok": bool, "error": str}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.vllm_engine import ENGINE_ENV, generate, kv_transfer_config, make_llm, prompt


def main(model: Path, socket: str, out: Path) -> None:
    llm = make_llm(model, kv_transfer_config(socket, model_id="idle-reset"),
                   prefix_caching=True)
    generate(llm, [prompt(5, 300), prompt(6, 200)])   # saved; decoding acknowledges them
    time.sleep(0.5)
    core = llm.llm_engine.engine_core.engine_core
    try:
        core.pause_scheduler(mode="abort", clear_cache=True)
        result = {"ok": True, "error": ""}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.update(ENGINE_ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)   # (vLLM's in-process engine may hang at interpreter exit)
