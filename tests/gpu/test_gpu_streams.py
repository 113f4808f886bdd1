"""LayerStreams on a real device: per-layer events, loads off the compute stream."""

from __future__ import annotations

import pytest
from kvtier.kernels.cuda_stream import LayerStreams

pytestmark = pytest.mark.gpu


def test_wait_for_layer_waits_on_that_layer_only():
    import torch

    streams = LayerStreams(2, device="cuda")
    assert streams.is_async
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    dst = [torch.zeros_like(src), torch.zeros_like(src)]
    streams.start_step()
    streams.load_layer(0, lambda s: dst[0].copy_(src))
    # Layer 1's load is held back by a long sleep on the load stream.
    streams.load_layer(1, lambda s: (torch.cuda._sleep(2_000_000_000), dst[1].copy_(src)))
    streams.wait_for_layer(0)
    out = dst[0] * 2  # compute stream: ordered after layer 0's event only
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, src * 2)
    assert not streams.layer_loaded(1)  # still sleeping: compute did not wait for it
    streams.wait_for_layer(1)
    torch.cuda.current_stream().synchronize()
    assert streams.layer_loaded(1) and torch.equal(dst[1], src)


def test_saves_run_after_queued_compute_and_wait_for_saves_blocks():
    import torch

    streams = LayerStreams(1, device="cuda")
    kv = torch.zeros(1 << 20, device="cuda")
    host = torch.empty(1 << 20).pin_memory()
    torch.cuda._sleep(200_000_000)
    kv.fill_(3.0)  # the "forward pass" writes the layer's KV
    streams.save_layer(0, lambda s: host.copy_(kv, non_blocking=True))
    streams.wait_for_saves()
    assert bool((host == 3.0).all())
