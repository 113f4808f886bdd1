"""End to end with another model geometry than the shared tiny Llama: 3 layers, one KV head
(multi-query attention), head_dim 64, in bfloat16, kvtier blocks of one vLLM page. The
connector derives the block layout from the engine's KV cache, so nothing here is
configured for the geometry: a fresh engine reloads what the first one saved, its outputs
equal an engine without kvtier, and the daemon holds the layout the engine has."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.e2e.conftest import EngineRun
from tests.e2e.vllm_engine import (
    BLOCK_SIZE,
    TOKENS_PER_BLOCK,
    build_tiny_llama,
    build_tiny_swa,
    engine_layout,
    engine_model_id,
    kv_transfer_config,
    prompt,
)
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 3, 1, 64, "bfloat16"
PROMPTS = [prompt(41, 200), prompt(42, 330)]


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-mqa"), layers=LAYERS,
                            kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def test_an_mqa_bf16_model_reloads_exactly_in_a_fresh_engine(
        run_engine: EngineRun, daemon: DaemonProcess, mqa_model: Path) -> None:
    (expected,) = run_engine([{"prompts": PROMPTS}], transfer=None, model=mqa_model,
                             dtype=DTYPE)
    transfer = kv_transfer_config(daemon.socket, model_id="tiny-mqa",
                                  tokens_per_block=BLOCK_SIZE)
    (first,) = run_engine([{"prompts": PROMPTS}], transfer=transfer, model=mqa_model,
                          dtype=DTYPE)
    (second,) = run_engine([{"prompts": PROMPTS}], transfer=transfer, model=mqa_model,
                           dtype=DTYPE)
    for (want, _), (got1, cached1), (got2, cached2), p in zip(expected, first, second,
                                                              PROMPTS, strict=True):
        assert got1 == want and got2 == want
        assert cached1 == 0
        # every whole block of the prompt but the last token's comes from kvtier
        assert cached2 == (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE, (len(p), cached2)
    # the daemon holds the blocks under this geometry's own layout: a client keying the
    # prompts with it finds every full block of each one (the layout is in the namespace)
    layout = engine_layout(KVLayout(num_layers=LAYERS, num_kv_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, dtype=DTYPE, tokens_per_block=BLOCK_SIZE))
    c = connect(daemon.socket)
    try:
        ns = c.register_layout(layout, engine_model_id("tiny-mqa", mqa_model, DTYPE))
        for p in PROMPTS:
            keys = block_keys(ns, p)
            assert c.lookup(ns, keys, prefetch=False).hits == len(keys) == len(p) // BLOCK_SIZE
        cpu = c.stats()["tiers"]["cpu"]
        assert cpu["blocks"] >= sum(len(p) // BLOCK_SIZE for p in PROMPTS)
        assert cpu["bytes_written"] % layout.block_bytes == 0, (cpu, layout.block_bytes)
    finally:
        c.close()


def test_a_model_mixing_sliding_window_and_full_layers_reloads_exactly(
        run_engine: EngineRun, daemon: DaemonProcess,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A window of 48 tokens in two of three layers (a tiny Gemma 3; gpt-oss and Ministral
    mix them too): vLLM runs such a model with a connector that does not declare hybrid support
    without its hybrid KV cache manager, so the sliding layers' pages keep every token as
    the full layer's do, and a block holds all three. Prompts far longer than the window:
    a reload in a fresh engine gives the tokens of an engine without kvtier."""
    model = build_tiny_swa(tmp_path_factory.mktemp("tiny-swa"))
    prompts = [prompt(61, 5 * TOKENS_PER_BLOCK + 17), prompt(62, 3 * TOKENS_PER_BLOCK + 40)]
    (expected,) = run_engine([{"prompts": prompts}], transfer=None, model=model)
    transfer = kv_transfer_config(daemon.socket, model_id="tiny-swa")
    (first,) = run_engine([{"prompts": prompts}], transfer=transfer, model=model)
    (second,) = run_engine([{"prompts": prompts}], transfer=transfer, model=model)
    for (want, _), (got1, cached1), (got2, cached2), p in zip(expected, first, second,
                                                              prompts, strict=True):
        assert got1 == want and got2 == want
        assert cached1 == 0
        assert cached2 == (len(p) - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK, (len(p), cached2)


def test_cpu_engines_of_another_page_size_never_load_each_others_kv(
        run_engine: EngineRun, daemon: DaemonProcess) -> None:
    """vLLM's CPU attention interleaves K rows per page in groups of 32 tokens at pages of
    64 tokens or more: an engine with 128-token pages loaded what one with 32-token pages
    saved and gave wrong tokens (found by review). The kernel and page size are part of
    the namespace (``geometry.with_engine_page_format``): each reloads only its own."""
    prompts = [prompt(500 + i, n) for i, n in enumerate((257, 300))]
    big = {"block_size": 128}
    (want,) = run_engine([{"prompts": prompts}], engine_args=big)
    transfer = kv_transfer_config(daemon.socket, model_id="page-size", tokens_per_block=128)
    (small,) = run_engine([{"prompts": prompts}], transfer)   # 32-token pages: saves
    assert [t for t, _ in small] == [t for t, _ in want]
    first, again = run_engine([{"prompts": prompts}, {"prompts": prompts}], transfer,
                              engine_args=big)
    assert [c for _, c in first] == [0, 0]        # not the other page size's blocks
    assert [t for t, _ in first] == [t for t, _ in want]
    assert [c for _, c in again] == [256, 256]    # its own, saved in the first phase
    assert [t for t, _ in again] == [t for t, _ in want]
