"""New weights under the same model path: the KV the old weights computed must never be
served to an engine of the new ones (a fine-tune or a new revision deployed in place is an
everyday operation, and stale KV gives wrong tokens with no error anywhere). The connector
appends a fingerprint of the checkpoint to the model id (kvtier.weights), so the new
engine misses, recomputes, and then reuses its own KV; with ``model_fingerprint = "off"``
the same sequence serves the stale KV and the tokens go wrong, which is what this guards."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, EngineRun, Zygote
from tests.e2e.vllm_engine import BLOCK_SIZE, build_tiny_llama, kv_transfer_config, prompt
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

PROMPTS = [prompt(71, 200), prompt(72, 257)]


@pytest.fixture()
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="64MiB") as d:
        yield d


def whole_pages(p: list[int]) -> int:
    return (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("fingerprint", ["auto", "off"])
def test_kv_of_replaced_weights_is_never_served(run_engine: EngineRun, daemon: DaemonProcess,
                                                tmp_path: Path, fingerprint: str) -> None:
    model = build_tiny_llama(tmp_path / "model", seed=1)
    transfer = kv_transfer_config(daemon.socket, model_id="deployed",
                                  model_fingerprint=fingerprint)
    (old,) = run_engine([{"prompts": PROMPTS}], transfer=transfer, model=model)
    assert all(cached == 0 for _, cached in old)
    build_tiny_llama(model, seed=2)          # new weights, same path, same config
    (want,) = run_engine([{"prompts": PROMPTS}], transfer=None, model=model)
    assert [t for t, _ in want] != [t for t, _ in old]   # the weights really differ
    new, again = run_engine([{"prompts": PROMPTS}, {"prompts": PROMPTS}], transfer=transfer,
                            model=model)
    if fingerprint == "off":   # the hazard: the old KV is found and the tokens go wrong
        assert [cached for _, cached in new] == [whole_pages(p) for p in PROMPTS]
        assert [t for t, _ in new] != [t for t, _ in want]
        return
    assert new == [(t, 0) for t, _ in want]             # a miss: recomputed, exact
    assert again == [(t, whole_pages(p)) for (t, _), p in zip(want, PROMPTS, strict=True)]


def test_an_in_place_weight_update_never_loads_the_old_weights_kv(tmp_path: Path,
                                                                  zygote: Zygote) -> None:
    """vLLM's weight-update flow resets its caches with ``reset_connector=True``; the
    connector ignored it and served the old weights' KV: wrong tokens (found by review).
    After the reset every request keys a new weights generation."""
    from tests.e2e.vllm_engine import ENGINE_ENV

    old, new = build_tiny_llama(tmp_path / "old", seed=1), build_tiny_llama(tmp_path / "new",
                                                                             seed=2)
    out = tmp_path / "out.json"
    with DaemonProcess(tmp_path / "kvd", cpu_bytes="64MiB", nvme_bytes="0") as d:
        zygote.check([str(Path(__file__).with_name("weights_update_engine.py")), str(old),
                      str(new), str(d.socket), str(out)], tmp_path / "engine.log",
                     {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO)}, out)
    r = json.loads(out.read_text())
    assert r["want"] != r["old"]   # the update changed what the prompt computes
    assert r["got"] == r["want"], r["cached"]
