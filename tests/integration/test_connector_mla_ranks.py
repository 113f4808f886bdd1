"""The worker side of a TP 2 engine with an MLA latent cache, driven directly against a real
daemon: both ranks load rank 0's latents from the one namespace they share, only rank 0
saves, and rank 1 lets vLLM free a finished request's pages at once (vLLM waits for every
rank's report before it frees them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")
if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.metadata import (
    KVTierConnectorMetadata,
    TransferSpec,
)
from kvtier.connectors.vllm.worker import WorkerSide

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.worker_side import finished

LAYERS, PAGE, TPB, LATENT, NUM_PAGES = 3, 16, 64, 576, 32
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=LATENT, dtype="float32",
                  tokens_per_block=TPB, kv_components=1)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("mla-daemon"), cpu_bytes="32MiB",
                       nvme_bytes="64MiB") as d:
        yield d


def caches(seed: int) -> dict[str, torch.Tensor]:
    """Per-layer latent caches as the CPU MLA backend allocates them: [pages, 1, page, 576]."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_PAGES, 1, PAGE, LATENT,
                                                            generator=g)
            for i in range(LAYERS)}


def worker(d: DaemonProcess, rank: int, kv: dict[str, torch.Tensor]) -> WorkerSide:
    cfg = ConnectorConfig.from_extra({"socket_path": str(d.socket), "tokens_per_block": TPB,
                                      "model_id": "mla"}, block_size=PAGE,
                                     default_model_id="mla")
    w = WorkerSide(cfg, LAYOUT, PAGE, rank, 2, replicas=2, agree=lambda cuts: cuts)
    w.register_kv_caches(kv)
    return w


def test_rank_0_alone_saves_the_latent_and_both_ranks_load_it(daemon: DaemonProcess) -> None:
    toks = np.random.default_rng(3).integers(1, 30000, 2 * TPB, dtype=np.uint32)
    src = [[1, 2, 3, 4], [5, 6, 7, 8]]
    kv0, kv1 = caches(0), caches(1)
    w0, w1 = worker(daemon, 0, kv0), worker(daemon, 1, kv1)
    try:
        meta = KVTierConnectorMetadata(saves=[TransferSpec("r", None, toks, 0, src,
                                                           save_id=4)])
        w1.save(meta)
        assert w1.get_finished({"r"})[0] == {"r"}          # nothing of its own to wait for
        done = w1.worker_meta()
        assert done.saves_done == {4: 1} and "saved_blocks" not in done.counters
        c = connect(daemon.socket)
        try:
            ns = c.register_layout(LAYOUT, "mla")
            keys = block_keys(ns, toks)
            assert c.lookup(ns, keys, prefetch=False).hits == 0   # rank 1 stored nothing
            w0.save(meta)
            finished(w0, "r")
            assert w0.worker_meta().counters["saved_blocks"] == 2
            assert c.lookup(ns, keys, prefetch=False).hits == 2   # one copy, keyed as TP 1
        finally:
            c.close()
        dst = [[11, 12, 13, 14], [15, 16, 17, 18]]
        for w, kv in ((w0, kv0), (w1, kv1)):
            w.start_load_kv(KVTierConnectorMetadata(loads=[TransferSpec("q", None, toks, 0,
                                                                        dst)]))
            for name in w.layer_index:
                w.wait_for_layer_load(name)
            assert w.take_load_errors() == set()
            flat_src = [p for row in src for p in row]
            flat_dst = [p for row in dst for p in row]
            for name, cache in kv.items():
                assert torch.equal(cache[flat_dst], kv0[name][flat_src])   # rank 0's latent
    finally:
        w0.shutdown()
        w1.shutdown()
