"""End to end: a real vLLM engine (in this process) with KVTierConnector and a real daemon.

One engine serves the whole module (engine start-up dominates the suite's time). It starts
*before* the daemon, so the first test is "daemon absent at start"; the daemon is then
started, killed, restarted and corrupted by later tests, which run in file order, and the
engine must reconnect and keep producing the baseline tokens throughout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from tests.e2e.conftest import PROMPTS, max_tokens_of
from tests.e2e.vllm_engine import (
    ENGINE_ENV,
    TOKENS_PER_BLOCK,
    engine_layout,
    engine_model_id,
    generate,
    kv_transfer_config,
    make_llm,
)
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

MODEL_ID = "tiny-llama"
RECONNECT_WAIT_S = 1.3  # > reconnect_max_s of the test config


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """The daemon, not started: tests start, kill and restart it."""
    d = DaemonProcess(tmp_path_factory.mktemp("kvtierd"), cpu_bytes="64MiB",
                      nvme_bytes="128MiB")
    yield d
    d.kill()


@pytest.fixture(scope="module")
def llm(tiny_model: Path, daemon: DaemonProcess) -> Iterator[Any]:
    saved = {k: os.environ.get(k) for k in (*ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ.update(ENGINE_ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = make_llm(tiny_model, kv_transfer_config(daemon.socket, model_id=MODEL_ID))
    yield engine
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture()
def live(daemon: DaemonProcess) -> DaemonProcess:
    """The daemon, running (started on first use, or again after a test stopped it)."""
    if daemon.proc is None or daemon.proc.poll() is not None:
        daemon.start()
        time.sleep(RECONNECT_WAIT_S)  # let the connector's backoff window pass
    return daemon


def run(llm: Any, name: str, salt: str | None = None) -> tuple[list[int], int]:
    ((tokens, cached),) = generate(llm, [PROMPTS[name]], [salt], max_tokens_of(name))
    return tokens, cached


def full_blocks_tokens(name: str) -> int:
    """Tokens a hit covers: whole kvtier blocks, never the last prompt token."""
    n = len(PROMPTS[name])
    return min(n // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK, n - 1)


def namespace(model: Path, salt: str | None = None) -> Namespace:
    """The namespace the engine of ``model`` saves under (its weights fingerprint in it)."""
    layout = engine_layout(KVLayout(num_layers=2, num_kv_heads=2, head_dim=32,
                                    dtype="float32", tokens_per_block=TOKENS_PER_BLOCK))
    return Namespace(engine_model_id(MODEL_ID, model), layout, 0, 1, salt)


def test_daemon_absent_at_start(llm: Any, daemon: DaemonProcess,
                                baseline: dict[str, list[int]],
                                caplog: pytest.LogCaptureFixture) -> None:
    assert daemon.proc is None
    caplog.set_level(logging.WARNING, logger="kvtier.connectors.vllm")
    for _ in range(3):
        tokens, cached = run(llm, "absent")
        assert tokens == baseline["absent"]
        assert cached == 0
    warnings = [r for r in caplog.records if "daemon unavailable" in r.getMessage()]
    assert 1 <= len(warnings) <= 2  # one per side (scheduler, worker), not one per step


def test_repeated_prompt_loads_prefix(llm: Any, live: DaemonProcess,
                                      baseline: dict[str, list[int]]) -> None:
    first, cached0 = run(llm, "repeat")
    assert (first, cached0) == (baseline["repeat"], 0)
    second, cached1 = run(llm, "repeat")
    assert cached1 == full_blocks_tokens("repeat") == 256
    assert second == baseline["repeat"]
    stats = live.stats()["requests"]
    assert stats["get_blocks"] >= 4 and stats["put_blocks"] >= 4


def test_prompt_of_whole_blocks_recomputes_only_last_token(
        llm: Any, live: DaemonProcess, baseline: dict[str, list[int]]) -> None:
    run(llm, "exact")
    tokens, cached = run(llm, "exact")
    assert cached == len(PROMPTS["exact"]) - 1
    assert tokens == baseline["exact"]


def test_shared_first_blocks_reuse_exactly_those(llm: Any, live: DaemonProcess,
                                                 baseline: dict[str, list[int]]) -> None:
    run(llm, "repeat")  # present whatever ran before
    tokens, cached = run(llm, "shared2")
    assert cached == 2 * TOKENS_PER_BLOCK
    assert tokens == baseline["shared2"]


def test_cache_salts_never_share(llm: Any, live: DaemonProcess,
                                 baseline: dict[str, list[int]]) -> None:
    expected = baseline["salted"]
    assert run(llm, "salted", "alice") == (expected, 0)
    assert run(llm, "salted", "bob") == (expected, 0)
    assert run(llm, "salted", None) == (expected, 0)
    assert run(llm, "salted", "alice") == (expected, full_blocks_tokens("salted"))
    assert run(llm, "salted", "bob") == (expected, full_blocks_tokens("salted"))


def test_injected_kv_is_used(llm: Any, live: DaemonProcess, tiny_model: Path,
                             baseline: dict[str, list[int]]) -> None:
    """Well-framed but wrong KV under the prompt's keys changes the output: the loaded
    KV really feeds attention. Removing it restores the baseline."""
    from kvtier.client import connect

    expected = baseline["inject"]
    assert run(llm, "inject")[0] == expected
    ns = namespace(tiny_model)
    keys = block_keys(ns, PROMPTS["inject"])
    rng = np.random.default_rng(0)
    garbage = [rng.standard_normal(ns.layout.block_bytes // 4).astype(np.float32) * 3
               for _ in keys]
    with connect(live.socket, timeout=5.0) as client:
        assert client.delete(ns, keys) == len(keys)
        assert client.put(ns, keys, garbage) == len(keys)
        tokens, cached = run(llm, "inject")
        assert cached == full_blocks_tokens("inject")
        assert tokens != expected
        client.delete(ns, keys)
    assert run(llm, "inject") == (expected, 0)     # miss: recomputed and saved again
    assert run(llm, "inject") == (expected, full_blocks_tokens("inject"))


def test_corrupted_nvme_payload_is_rejected(llm: Any, live: DaemonProcess,
                                            baseline: dict[str, list[int]]) -> None:
    """Flip payload bytes of the nvme slot files (frames untouched): the daemon's checksum
    rejects them, the connector reports the pages, vLLM recomputes the same tokens."""
    expected = baseline["corrupt"]
    assert run(llm, "corrupt") == (expected, 0)
    assert live.terminate() == 0          # graceful drain persists cpu blocks to nvme
    corrupted = corrupt_nvme_payloads(live.data_dir / "nvme")
    assert corrupted > 0
    live.start()
    time.sleep(RECONNECT_WAIT_S)
    tokens, _ = run(llm, "corrupt")
    assert tokens == expected
    nvme = live.stats()["tiers"]["nvme"]
    assert nvme["checksum_failures"] > 0
    # the recomputed blocks were offloaded again and now load cleanly
    assert run(llm, "corrupt") == (expected, full_blocks_tokens("corrupt"))


def test_daemon_killed_mid_run(llm: Any, live: DaemonProcess,
                               baseline: dict[str, list[int]]) -> None:
    names = [n for n in PROMPTS if n.startswith("kill")]
    prompts = [PROMPTS[n] for n in names]
    max_tokens = max_tokens_of(names[0])
    generate(llm, prompts, max_tokens=max_tokens)        # offload their prefixes
    killer = threading.Timer(0.05, live.kill)
    killer.start()
    t0 = time.monotonic()
    outs = generate(llm, prompts, max_tokens=max_tokens)  # loads, then the daemon dies
    killer.join()
    assert time.monotonic() - t0 < 60
    assert live.proc is not None and live.proc.poll() is not None
    for name, (tokens, _) in zip(names, outs, strict=True):
        assert tokens == baseline[name], name
    # with the daemon still dead, requests keep flowing
    assert run(llm, "reconnect") == (baseline["reconnect"], 0)
    # restarted: the connector reconnects on its own
    live.start()
    time.sleep(RECONNECT_WAIT_S)
    assert run(llm, "reconnect") == (baseline["reconnect"], 0)
    assert run(llm, "reconnect") == (baseline["reconnect"], full_blocks_tokens("reconnect"))


def corrupt_nvme_payloads(nvme_dir: Path) -> int:
    """Overwrite 64 bytes in the middle of every slot's payload; returns slots touched.

    Slot file layout (kvtier.tiers.nvme): ``slots-<slot_bytes>.dat``, slot ``i`` at
    ``i * (4096 + slot_bytes)``, a 4 KiB header page then the payload.
    """
    touched = 0
    for f in sorted(nvme_dir.glob("slots-*.dat")):
        slot_bytes = int(f.stem.split("-")[1])
        stride = 4096 + slot_bytes
        size = f.stat().st_size
        with open(f, "r+b") as fh:
            for i in range(size // stride):
                fh.seek(i * stride + 4096 + slot_bytes // 2)
                fh.write(b"\xa5" * 64)
                touched += 1
    return touched


def test_layer_waits_follow_the_copies_in_the_engine(llm: Any, live: DaemonProcess,
                                                     baseline: dict[str, list[int]]) -> None:
    """In the real engine every attention layer waits for its own layer's load, and none
    runs before that layer's copy is complete."""
    from kvtier.connectors.vllm.connector import KVTierConnector
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    assert isinstance(connector, KVTierConnector)
    worker = connector._worker
    assert worker is not None
    run(llm, "repeat")
    assert run(llm, "repeat") == (baseline["repeat"], full_blocks_tokens("repeat"))
    assert worker.pipeline is not None
    trace = worker.pipeline.last_trace
    assert trace is not None and trace.finished_at is not None
    for ready, waited in zip(trace.ready_at, trace.waited_at, strict=True):
        assert ready is not None and waited is not None and ready <= waited


def test_pages_are_freed_only_after_the_saves_and_lookups_wait_for_them(
        llm: Any, live: DaemonProcess, baseline: dict[str, list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request finishes while its saves are held back: vLLM keeps its pages (delayed
    free) until the worker reports it in ``finished_sending``. The same prompt arriving
    meanwhile waits for the save instead of missing, then loads it."""
    from kvtier.connectors.vllm import pending as pending_module
    from kvtier.connectors.vllm import transfers

    monkeypatch.setattr(pending_module, "PENDING_SAVE_WAIT_S", 120.0)  # loaded machines
    gate = threading.Event()
    original = transfers.SaveRequest.copy

    def gated(self: Any, stream: Any) -> None:
        assert gate.wait(60)
        original(self, stream)

    monkeypatch.setattr(transfers.SaveRequest, "copy", gated)
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    side = scheduler.connector._scheduler
    assert run(llm, "delay") == (baseline["delay"], 0)
    held = [r for r in scheduler.requests.values() if r.is_finished()]
    assert len(held) == 1                                  # finished, not freed
    assert scheduler.kv_cache_manager.get_block_ids(held[0].request_id)[0]
    lookups = side.lookups
    second: list[tuple[list[int], int]] = []
    again = threading.Thread(target=lambda: second.append(run(llm, "delay")))
    again.start()
    deadline = time.monotonic() + 60
    while side.lookups == lookups:                         # it asked, and was told "not yet"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not second
    gate.set()
    again.join(60)
    assert second == [(baseline["delay"], full_blocks_tokens("delay"))]
    assert not any(r.is_finished() for r in scheduler.requests.values())


def test_new_prompts_are_answered_without_a_round_trip(llm: Any, live: DaemonProcess) -> None:
    """A prompt the daemon holds nothing of is answered from its presence filter (no
    lookup round trip, counted); the same prompt again goes to the daemon and loads, with
    the tokens of the first (recomputed) run."""
    from tests.e2e.vllm_engine import prompt

    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    lookups = live.stats()["requests"]["lookups"]
    local = side.counters["lookups_without_round_trip"]
    fresh = prompt(4242, 3 * TOKENS_PER_BLOCK + 7)
    ((first, cached0),) = generate(llm, [fresh])
    assert cached0 == 0
    assert side.counters["lookups_without_round_trip"] == local + 1
    assert live.stats()["requests"]["lookups"] == lookups       # the daemon was not asked
    ((second, cached1),) = generate(llm, [fresh])
    assert cached1 == 3 * TOKENS_PER_BLOCK and second == first
    assert side.counters["lookups_without_round_trip"] == local + 1


def test_prompt_logprobs_request_is_not_looked_up_and_is_saved(
        llm: Any, live: DaemonProcess) -> None:
    """A request that asks for prompt logprobs needs every prompt token computed (vLLM
    drops any cache hit for it): the connector does not ask the daemon, the logprobs cover
    the whole prompt, and its KV is still saved for the next plain request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.e2e.vllm_engine import prompt

    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    fresh = prompt(4343, 3 * TOKENS_PER_BLOCK + 5)
    ((plain, cached0),) = generate(llm, [fresh])                # computed, then saved
    assert cached0 == 0
    lookups = live.stats()["requests"]["lookups"]
    skipped = side.counters["lookups_prefix_read_off"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=fresh)], params, use_tqdm=False)
    assert int(out.num_cached_tokens or 0) == 0
    assert len(out.prompt_logprobs) == len(fresh)              # first is None, as always
    assert all(lp for lp in out.prompt_logprobs[1:])
    assert list(out.outputs[0].token_ids) == plain[:4]
    assert side.counters["lookups_prefix_read_off"] == skipped + 1
    assert live.stats()["requests"]["lookups"] == lookups       # the daemon was not asked
    ((again, cached1),) = generate(llm, [fresh])
    assert (again, cached1) == (plain, 3 * TOKENS_PER_BLOCK)


def test_parallel_samples_from_loaded_kv_equal_those_from_computed_kv(
        llm: Any, live: DaemonProcess) -> None:
    """``n`` seeded samples of one prompt: vLLM runs them as child requests of one parent,
    each with its own id. Loaded from kvtier, they are the samples the computed KV gave."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.e2e.vllm_engine import prompt

    fresh = TokensPrompt(prompt_token_ids=prompt(4444, 3 * TOKENS_PER_BLOCK + 9))
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)

    def samples() -> tuple[list[list[int]], int]:
        (out,) = llm.generate([fresh], params, use_tqdm=False)
        return [list(c.token_ids) for c in out.outputs], int(out.num_cached_tokens or 0)

    computed, cached0 = samples()
    loaded, cached1 = samples()
    assert cached0 == 0 and cached1 == 3 * TOKENS_PER_BLOCK
    assert len({tuple(s) for s in computed}) > 1                 # really different samples
    assert loaded == computed
