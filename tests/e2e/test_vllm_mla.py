"""End to end with multi-head latent attention (a tiny random DeepSeek-V2 on vLLM's CPU MLA
backend): the KV cache is one 576-wide latent per token and layer, not K and V.

What is checked is the latents themselves, page by page in the engines (worker_hooks.
record_pages), not the tokens: vLLM 0.32's CPU MLA prefill over a cached context computes
other tokens than a full prefill even with vLLM's own prefix cache forced on (which is why
its CPU platform turns prefix caching off for MLA models, and why the connector then does
not load by default: ``context_reuse``, turned on here; docs/vllm-connector.md), so on
this machine token equality after a reload would test vLLM, not kvtier. A reload must put
in an engine's pages, bit for bit, what the engine that saved them computed, and the
daemon must hold them in kvtier's canonical order (layer, token, latent), whatever the
backend's page shape (the CPU backend's has a head dimension of 1).

Under tensor parallelism every rank holds the whole latent: the ranks share one namespace
(keyed as TP 1, so engines of any TP size share the blocks), rank 0 alone saves, and all
ranks still agree where a step's saves stop, since rank 0's later latents depend, through
the all-reduce, on what every rank loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.e2e.conftest import EngineRun
from tests.e2e.vllm_engine import (
    TOKENS_PER_BLOCK,
    build_tiny_mla,
    engine_model_id,
    kv_transfer_config,
    prompt,
)
from tests.e2e.worker_hooks import block_name
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

LATENT = 512 + 64        # kv_lora_rank + qk_rope_head_dim
LAYERS = 2
PREFIX = prompt(50, 3 * TOKENS_PER_BLOCK + 11)
PROMPT = PREFIX + prompt(51, 150)      # 5 blocks; a reload of PREFIX's 3 computes 3 and 4
OTHER = prompt(52, 2 * TOKENS_PER_BLOCK + 5)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mla(tmp_path_factory.mktemp("tiny-mla"), layers=LAYERS)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("kvtierd-mla"), cpu_bytes="64MiB") as d:
        yield d


def _layout() -> KVLayout:
    return KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=LATENT, dtype="float32",
                    tokens_per_block=TOKENS_PER_BLOCK, kv_components=1)


def _pages(records: Path, kind: str, rank: int, salt: str | None, tokens: list[int],
           block: int) -> list[np.ndarray]:
    name = block_name(salt, tokens, (block + 1) * TOKENS_PER_BLOCK)
    files = [records / f"{kind}-{rank}-{name}-{layer}.npy" for layer in range(LAYERS)]
    assert all(f.exists() for f in files), f"no {kind} record of block {block} on rank {rank}"
    return [np.load(f) for f in files]


def test_an_mla_model_reloads_its_latents_bit_for_bit(
        run_engine: EngineRun, daemon: DaemonProcess, mla_model: Path,
        tmp_path: Path) -> None:
    # by default a CPU MLA engine saves but never loads: vLLM turned context reuse off
    # for it (context_reuse "auto"), so its second phase computes every prompt again
    cfg = kv_transfer_config(daemon.socket, model_id="tiny-mla")
    first, repeated = run_engine([{"prompts": [PROMPT, OTHER]}, {"prompts": [PROMPT, OTHER]}],
                                 cfg, model=mla_model, record_pages=tmp_path)
    assert [cached for _, cached in first + repeated] == [0, 0, 0, 0]
    # with loads turned on, a fresh engine loads every whole block but the one holding the
    # last prompt token, as the first engine saved them
    cfg["kv_connector_extra_config"]["context_reuse"] = "on"
    (again,) = run_engine([{"prompts": [PROMPT, OTHER]}], cfg, model=mla_model,
                          record_pages=tmp_path)
    for (_, cached), p in zip(again, [PROMPT, OTHER], strict=True):
        assert cached == (len(p) - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
        for block in range(cached // TOKENS_PER_BLOCK):
            for computed, loaded in zip(_pages(tmp_path, "computed", 0, None, p, block),
                                        _pages(tmp_path, "loaded", 0, None, p, block),
                                        strict=True):
                assert computed.shape == (TOKENS_PER_BLOCK // 16, 16, LATENT)
                assert np.array_equal(computed, loaded), block
    # the daemon holds them under the latent's layout: one component 576 wide, a block
    # of 2 layers x 64 tokens x 576 floats (not twice that, as K and V would be)
    c = connect(daemon.socket)
    try:
        ns = c.register_layout(_layout(), engine_model_id("tiny-mla", mla_model))
        for p in (PROMPT, OTHER):
            keys = block_keys(ns, p)
            assert c.lookup(ns, keys, prefetch=False).hits == len(keys)
        assert _layout().block_bytes == LAYERS * TOKENS_PER_BLOCK * LATENT * 4
        with c.prepare_get(ns, block_keys(ns, PROMPT)[1:2]) as lease:
            stored = np.frombuffer(bytes(lease.views[0]), dtype=np.float32)
        canonical = np.concatenate([page.reshape(-1) for page in
                                    _pages(tmp_path, "computed", 0, None, PROMPT, 1)])
        assert np.array_equal(stored, canonical)
    finally:
        c.close()


TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "max_model_len": 1024}


def test_tp2_ranks_share_one_latent_copy_and_agree_on_a_failed_load(
        run_engine: EngineRun, daemon: DaemonProcess, mla_model: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's load of a reload fails (its pages hold noise until recomputed) while rank
    0's succeeds. Rank 0, the only saver, must not store the blocks it computed in that
    step (3 and 4, on rank 1's noise through the all-reduce): the recompute's saves would
    then find them present and keep them, and the next reload would load them. So both
    ranks' last reload must hold, bit for bit, what the recompute computed.

    (Latents are compared with what the same step computed, not with another prefill of
    the same tokens: vLLM 0.32's CPU MLA under TP 2 computes some rows differently from
    one prefill to the next, even in layer 0.)"""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    cfg = kv_transfer_config(daemon.socket, model_id="tiny-mla-tp", context_reuse="on")
    phases = [{"prompts": [PREFIX + prompt(53, 30)], "salts": ["s"], "max_tokens": 2},
              {"prompts": [PROMPT], "salts": ["s"]},    # rank 1's load fails: recomputed
              {"prompts": [PROMPT], "salts": ["s"]}]    # reloads 5 blocks
    results = run_engine(phases, cfg, model=mla_model, engine_args=TP2, record_pages=tmp_path,
                         spoil_loads={"salt": "s", "from_block": 0, "rank": 1})
    assert [phase[0][1] for phase in results] == [0, 3 * TOKENS_PER_BLOCK,
                                                   5 * TOKENS_PER_BLOCK]
    for rank in (0, 1):
        for block in (3, 4):
            for computed, loaded in zip(_pages(tmp_path, "computed", 0, "s", PROMPT, block),
                                        _pages(tmp_path, "loaded", rank, "s", PROMPT, block),
                                        strict=True):
                assert np.array_equal(computed, loaded), (rank, block)
    # one copy of the latents, keyed as TP 1: a TP 1 client finds every block of the
    # prompt, and no rank-1 namespace holds any
    c = connect(daemon.socket)
    try:
        model_id = engine_model_id("tiny-mla-tp", mla_model)
        ns = c.register_layout(_layout(), model_id, cache_salt="s")
        keys = block_keys(ns, PROMPT)
        assert c.lookup(ns, keys, prefetch=False).hits == len(keys) == 5
        rank1 = c.register_layout(_layout(), model_id, tp_rank=1, tp_size=2, cache_salt="s")
        assert c.lookup(rank1, block_keys(rank1, PROMPT), prefetch=False).hits == 0
    finally:
        c.close()
