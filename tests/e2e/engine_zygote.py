"""A process that imports vLLM once and forks the e2e tests' engine processes from there.

Importing vLLM, torch and transformers takes 5-10 s of each engine process on a 2-core
machine, more than most e2e tests spend generating; ~70 engine runs paid it anew. The
zygote imports them once (without running any torch op: no OpenMP team exists to break
in a fork) and forks a fresh process per run, which sets the run's environment and log
and runs the engine script as ``__main__`` (``runpy``), exactly as ``python SCRIPT ARGS``
would: each engine is still a process of its own, with its own vLLM state, and a TP
worker started with "spawn" imports the script, as it would.

Protocol (one JSON object per line): the parent writes ``{"argv", "log", "env"}``; the
zygote answers ``{"pid": N}`` once the run's process exists (leading its own process
group, so that a timeout can kill it with the workers it started), then ``{"rc": N}``
when it ended (``os.waitstatus_to_exitcode``: negative for a signal). One run at a time.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _warm() -> None:
    """Import what every engine run imports (the modules ``LLM`` loads lazily too)."""
    import kvtier.connectors.vllm  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import vllm.entrypoints.llm
    import vllm.v1.engine.core
    import vllm.v1.engine.llm_engine
    import vllm.v1.executor.multiproc_executor
    import vllm.v1.worker.cpu_worker  # noqa: F401

    import tests.e2e.vllm_engine  # noqa: F401


def _child(req: dict[str, Any]) -> None:
    """The forked run: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        log = os.open(str(req["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(req["env"])
        argv = [str(a) for a in req["argv"]]
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    sys.path.insert(0, REPO)
    _warm()
    reply = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


if __name__ == "__main__":
    serve()
