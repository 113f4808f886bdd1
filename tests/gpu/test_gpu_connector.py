"""The connector's worker side on a real GPU (no vLLM needed): CUDA KV caches in the
FlashAttention NHD format (and an MLA latent cache), a real daemon, the arena registered
with cudaHostRegister, loads on the load stream with per-layer events, saves on the save
stream, and device views from the daemon's HBM pool. The CPU versions of these tests are
tests/integration/test_connector_worker.py (fake device)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.gpu

LAYERS, HEADS, DIM, PAGE, TPB = 8, 8, 128, 16, 256
PAGES_PER_BLOCK = TPB // PAGE
NUM_PAGES = 8 * PAGES_PER_BLOCK + 1
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16",
                  tokens_per_block=TPB)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("gpu-worker"), cpu_bytes="512MiB",
                       nvme_bytes="0") as d:
        yield d


def cuda_caches(seed: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(2, NUM_PAGES, PAGE, HEADS, DIM,
                                            dtype=torch.float16, device="cuda")
            for i in range(LAYERS)}


def gpu_worker(d: DaemonProcess, model: str, kv: dict[str, Any], **extra: Any) -> Any:
    from kvtier.connectors.vllm.config import ConnectorConfig
    from kvtier.connectors.vllm.worker import WorkerSide

    cfg = ConnectorConfig.from_extra({"socket_path": str(d.socket), "tokens_per_block": TPB,
                                      "model_id": model, **extra},
                                     block_size=PAGE, default_model_id=model)
    w = WorkerSide(cfg, LAYOUT, PAGE, 0, 1)
    w.register_kv_caches(kv)
    return w


def spec(req: str, seed: int, first_page: int, n: int, **kw: Any) -> Any:
    from kvtier.connectors.vllm.metadata import TransferSpec

    toks = np.random.default_rng(seed).integers(1, 30000, n * TPB, dtype=np.uint32)
    pages = [list(range(first_page + j * PAGES_PER_BLOCK, first_page + (j + 1) * PAGES_PER_BLOCK))
             for j in range(n)]
    return TransferSpec(req, None, toks, 0, pages, **kw)


def save_and_wait(w: Any, s: Any) -> None:
    from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata

    w.save(KVTierConnectorMetadata(saves=[s]))
    sending, _ = w.get_finished({s.req_id})
    deadline = time.monotonic() + WAIT_S
    while s.req_id not in sending:
        assert time.monotonic() < deadline
        time.sleep(0.002)
        sending, _ = w.get_finished(set())


def load_all(w: Any, s: Any) -> set[int]:
    import torch
    from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata

    w.start_load_kv(KVTierConnectorMetadata(loads=[s]))
    for name in w.layer_index:
        w.wait_for_layer_load(name)   # the compute stream waits on this layer's event
    errors = w.take_load_errors()
    torch.cuda.current_stream().synchronize()
    return errors


def same_pages(kv: dict[str, Any], a: Any, b: Any) -> bool:
    import torch

    pa, pb = a.page_ids, b.page_ids
    return all(torch.equal(c[:, pa], c[:, pb]) for c in kv.values())


def test_round_trip_through_the_registered_arena(daemon: DaemonProcess) -> None:
    kv = cuda_caches(0)
    w = gpu_worker(daemon, "gpu-rt", kv)
    src = spec("s", 1, 1, 4, save_id=1)
    save_and_wait(w, src)
    (reg,) = w.arenas.registrations.values()
    assert reg.ok, "cudaHostRegister of the arena failed"
    print(f"arena registration: {reg.nbytes / 2**30:.2f} GiB in {reg.seconds:.3f} s "
          f"({reg.seconds_per_8gib:.2f} s per 8 GiB)")
    dst = spec("l", 1, 1 + 4 * PAGES_PER_BLOCK, 4)
    for c in kv.values():
        c[:, dst.page_ids] = 0
    assert load_all(w, dst) == set()
    assert same_pages(kv, src, dst)
    trace = w.pipeline.last_trace
    assert all(r is not None and t is not None and r <= t
               for r, t in zip(trace.ready_at, trace.waited_at, strict=True))
    w.shutdown()


def test_an_mla_latent_cache_round_trips_through_the_arena(daemon: DaemonProcess) -> None:
    """GPU MLA backends (FlashMLA, FlashInfer, Triton) allocate one latent per token and
    layer as ``[pages, page, 576]``: saved and loaded on the streams like K and V pages."""
    import torch
    from kvtier.connectors.vllm.config import ConnectorConfig
    from kvtier.connectors.vllm.worker import WorkerSide

    latent = KVLayout(num_layers=LAYERS, num_kv_heads=1, head_dim=576, dtype="bfloat16",
                      tokens_per_block=TPB, kv_components=1)
    torch.manual_seed(3)
    kv = {f"layers.{i}.attn": torch.randn(NUM_PAGES, PAGE, 576, dtype=torch.bfloat16,
                                          device="cuda") for i in range(LAYERS)}
    cfg = ConnectorConfig.from_extra({"socket_path": str(daemon.socket), "tokens_per_block": TPB,
                                      "model_id": "gpu-mla"}, block_size=PAGE,
                                     default_model_id="gpu-mla")
    w = WorkerSide(cfg, latent, PAGE, 0, 1)
    w.register_kv_caches(kv)
    src = spec("s", 5, 1, 3, save_id=1)
    save_and_wait(w, src)
    dst = spec("l", 5, 1 + 3 * PAGES_PER_BLOCK, 3)
    for c in kv.values():
        c[dst.page_ids] = 0
    assert load_all(w, dst) == set()
    assert all(torch.equal(c[src.page_ids], c[dst.page_ids]) for c in kv.values())
    w.shutdown()


def test_compute_after_each_layer_wait_sees_that_layer(daemon: DaemonProcess) -> None:
    """What the forward does: read layer i right after wait_for_layer_load(i), on the
    compute stream, without a host synchronisation in between."""
    import torch
    from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata

    kv = cuda_caches(1)
    w = gpu_worker(daemon, "gpu-order", kv)
    src = spec("s", 2, 1, 2, save_id=1)
    save_and_wait(w, src)
    expected = {n: c[:, src.page_ids].clone() for n, c in kv.items()}
    dst = spec("l", 2, 1 + 2 * PAGES_PER_BLOCK, 2)
    for c in kv.values():
        c[:, dst.page_ids] = 0
    w.start_load_kv(KVTierConnectorMetadata(loads=[dst]))
    seen = {}
    for name, c in kv.items():
        w.wait_for_layer_load(name)
        seen[name] = c[:, dst.page_ids] * 1       # compute stream, ordered by the event
    assert w.take_load_errors() == set()
    torch.cuda.synchronize()
    assert all(torch.equal(seen[n], expected[n]) for n in kv)
    w.shutdown()


def test_device_views_from_the_hbm_pool(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "hbm", cpu_bytes="256MiB", nvme_bytes="0",
                      env={"KVTIER_HBM_ENABLED": "1", "KVTIER_HBM_BYTES": "128MiB"}).start()
    try:
        kv = cuda_caches(2)
        w = gpu_worker(d, "gpu-hbm", kv)
        assert w.device_loads                       # caches on a GPU: device loads
        src = spec("s", 3, 1, 3, save_id=1)
        save_and_wait(w, src)
        dst = spec("l", 3, 1 + 3 * PAGES_PER_BLOCK, 3)
        assert load_all(w, dst) == set()
        assert same_pages(kv, src, dst)
        hbm = d.stats()["tiers"]["hbm"]
        assert hbm["blocks"] == 3 and hbm["bytes_read"] >= 3 * LAYOUT.block_bytes
        w.shutdown()
    finally:
        d.kill()
