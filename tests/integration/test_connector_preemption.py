"""A preempted request's saves (worker side driven directly, real daemon, real CPU caches):
vLLM may hand the request's pages to another request in the very step it preempts it, so
the step waits for its saves, but only briefly: a save still running after that publishes
nothing (what it copies may be another request's KV by then)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")
pytest.importorskip("torch")

from kvtier.connectors.vllm import transfers
from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, TransferSpec
from kvtier.connectors.vllm.worker import PREEMPTED_SAVES_WAIT_S

from kvtier.keys import block_keys
from tests.integration.test_connector_worker import (
    WAIT_S,
    caches,
    make_daemon,
    rows,
    tokens,
    worker,
)
from tests.support.daemon import DaemonProcess


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = make_daemon(Path(tmp_path_factory.mktemp("preempt-daemon")))
    yield d
    d.kill()


def test_a_save_still_running_at_preemption_is_withdrawn_not_waited_for(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, copying = threading.Event(), threading.Event()
    original = transfers.SaveRequest.copy

    def held(self: Any, stream: Any) -> None:    # a save slowed down (a stalled daemon)
        copying.set()
        assert gate.wait(WAIT_S)
        original(self, stream)

    monkeypatch.setattr(transfers.SaveRequest, "copy", held)
    w = worker(daemon, "withdraw", caches(31))
    toks = tokens(31, 2)
    try:
        w.save(KVTierConnectorMetadata(saves=[TransferSpec("p", None, toks, 0, rows(1, 2),
                                                           save_id=1)]))
        assert copying.wait(WAIT_S)
        done = threading.Event()

        def preempt() -> None:
            w.handle_preemptions(["p"])
            done.set()

        threading.Thread(target=preempt, daemon=True).start()
        assert done.wait(PREEMPTED_SAVES_WAIT_S + 2.0), "the step waited for the save"
        gate.set()                                # the save goes on: its pages are reused
        deadline = time.monotonic() + WAIT_S
        while w.pipeline is not None and w.pipeline.inflight_bytes:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        meta = w.worker_meta()
        assert meta is not None and meta.counters.get("withdrawn_saves") == 1
        assert w.saved_blocks == 0
        ns = w.link.namespace(None, 0)
        assert w.link.lookup_result(ns, block_keys(ns, toks)).hits == 0
    finally:
        gate.set()
        w.shutdown()


def test_a_save_over_in_time_is_kept(daemon: DaemonProcess) -> None:
    w = worker(daemon, "kept", caches(32))
    toks = tokens(32, 2)
    try:
        w.save(KVTierConnectorMetadata(saves=[TransferSpec("q", None, toks, 0, rows(1, 2),
                                                           save_id=1)]))
        w.handle_preemptions(["q"])
        assert w.saved_blocks == 2
        ns = w.link.namespace(None, 0)
        assert w.link.lookup_result(ns, block_keys(ns, toks)).hits == 2
    finally:
        w.shutdown()
