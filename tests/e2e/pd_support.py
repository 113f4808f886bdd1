"""Running one engine of a prefill/decode pair (tests/e2e/pd_engine.py) from a P/D test:
in the foreground, or in the background with a gate mid-run, so a test can break a Redis
server while the engine is up and between two of its requests."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.layout import KVLayout
from tests.e2e.conftest import REPO, SUBPROCESS_TIMEOUT_S, Zygote
from tests.e2e.vllm_engine import ENGINE_ENV, TOKENS_PER_BLOCK, engine_layout, kv_transfer_config
from tests.support.daemon import DaemonProcess

RUNNER = Path(__file__).with_name("pd_engine.py")
LAYOUT = engine_layout(KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                                tokens_per_block=TOKENS_PER_BLOCK))   # the tiny Llama's KV
Rows = list[list[Any]]   # per prompt: [tokens, num_cached_tokens, seconds, redis_blocks]


class PdEngine:
    """One engine process over a list of prompts (see pd_engine.py for the spec), forked
    from the e2e tests' ``zygote`` (vLLM imported once) and run on a thread of this process,
    so that the test can act while it runs."""

    def __init__(self, tmp: Path, model: Path, transfer: dict[str, Any] | None,
                 prompts: list[list[int]], max_tokens: int, *, zygote: Zygote,
                 probe: DaemonProcess | None = None, pause_after: int | None = None) -> None:
        self.tmp, self.out = tmp, tmp / "out.json"
        spec: dict[str, Any] = {
            "model": str(model), "transfer": transfer, "prompts": prompts,
            "max_tokens": max_tokens, "probe_url": probe.http_url if probe else None,
            "probe_layout": LAYOUT.to_dict()}
        if pause_after is not None:
            spec["gate"] = {"after": pause_after, "dir": str(tmp)}
        (tmp / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self._log = tmp / "stderr.log"
        self._rc: list[int] = []
        argv = [str(RUNNER), str(tmp / "spec.json"), str(self.out)]
        self._thread = threading.Thread(
            target=lambda: self._rc.append(zygote.run(argv, self._log, env)), daemon=True)
        self._thread.start()

    def wait_paused(self) -> None:
        """Block until the engine has run the prompts before its gate and waits there."""
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while not (self.tmp / "paused").exists():
            assert self._thread.is_alive(), f"engine exited early:\n{self._tail()}"
            assert time.monotonic() < deadline, "engine never reached its gate"
            time.sleep(0.05)

    def go(self) -> None:
        (self.tmp / "go").touch()

    def result(self) -> tuple[Rows, dict[str, Any]]:
        """Wait for the engine to finish: its rows and its connector's counters (the
        zygote kills a run past SUBPROCESS_TIMEOUT_S)."""
        self._thread.join(SUBPROCESS_TIMEOUT_S + 120)
        rc = self._rc[0] if self._rc else None
        assert rc == 0 and self.out.exists(), f"engine process failed (rc={rc}):\n{self._tail()}"
        counters = json.loads(Path(str(self.out) + ".connector.json").read_text())
        return json.loads(self.out.read_text()), counters

    def _tail(self) -> str:
        return self._log.read_text(errors="replace")[-4000:] if self._log.exists() else ""


def run_pd_engine(tmp: Path, model: Path, transfer: dict[str, Any] | None,
                  prompts: list[list[int]], max_tokens: int, *, zygote: Zygote,
                  probe: DaemonProcess | None = None) -> tuple[Rows, dict[str, Any]]:
    """One engine process over ``prompts``, in the foreground."""
    return PdEngine(tmp, model, transfer, prompts, max_tokens, zygote=zygote,
                    probe=probe).result()


def role_config(node: DaemonProcess, role: str) -> dict[str, Any]:
    cfg = kv_transfer_config(node.socket, redis_sync_timeout_s=5.0, timeout_s=8.0)
    cfg["kv_role"] = role
    return cfg
