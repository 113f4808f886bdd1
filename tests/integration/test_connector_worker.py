"""The connector's worker side driven directly (no engine) against a real daemon process and
real CPU KV caches in vLLM's CPU page format: pipelined loads, saves off the critical path
with delayed freeing, the in-flight bound, lease expiry during a load, HBM device views
through the fake device, and one registered arena mapping per process.

Gates (threading.Event) hold a copy back where a test needs a transfer "in flight"; they
are released by the test, never by time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")
torch = pytest.importorskip("torch")

from kvtier.connectors.vllm import transfers  # noqa: E402
from kvtier.connectors.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.connectors.vllm.metadata import (  # noqa: E402
    KVTierConnectorMetadata,
    TransferSpec,
)
from kvtier.connectors.vllm.worker import WorkerSide  # noqa: E402

from kvtier.layout import KVLayout  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.support.fake_hbm import (  # noqa: E402
    DAEMON_PROGRAM,
    FakeHbmMapping,
    daemon_env,
    install_client_fake,
)
from tests.support.worker_side import finished  # noqa: E402

LAYERS = 12
PAGE = 32
TPB = 64
HEADS, HEAD_DIM = 2, 32
NUM_PAGES = 64
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float32",
                  tokens_per_block=TPB)
WAIT_S = 30.0


def make_daemon(root: Path, *, program: tuple[str, ...] | None = None,
                **env: str) -> DaemonProcess:
    """A real daemon; ``program``: DAEMON_PROGRAM for one with the fake HBM pool injected."""
    d = DaemonProcess(root, cpu_bytes="32MiB", nvme_bytes="64MiB", env=env)
    if program is not None:
        d.program = program
    return d.start()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = make_daemon(tmp_path_factory.mktemp("worker-daemon"))
    yield d
    d.kill()


def caches(seed: int) -> dict[str, Any]:
    """Per-layer caches in the CPU backend's format ``[pages, heads, page, 2*head]``."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn": torch.randn(NUM_PAGES, HEADS, PAGE, 2 * HEAD_DIM,
                                                       generator=g)
            for i in range(LAYERS)}


def worker(d: DaemonProcess, model: str, kv: dict[str, Any],
           register: Callable[[int, int], bool] | None = None, **extra: Any) -> WorkerSide:
    cfg = ConnectorConfig.from_extra({"socket_path": str(d.socket), "tokens_per_block": TPB,
                                      "model_id": model, **extra},
                                     block_size=PAGE, default_model_id=model)
    w = WorkerSide(cfg, LAYOUT, PAGE, 0, 1, register=register)
    w.register_kv_caches(kv)
    return w


def tokens(seed: int, n_blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, n_blocks * TPB, dtype=np.uint32)


def rows(first_page: int, n_blocks: int) -> list[list[int]]:
    return [[first_page + 2 * j, first_page + 2 * j + 1] for j in range(n_blocks)]


def save(w: WorkerSide, req: str, toks: np.ndarray, pages: list[list[int]],
         save_id: int) -> None:
    w.save(KVTierConnectorMetadata(saves=[TransferSpec(req, None, toks, 0, pages,
                                                       save_id=save_id)]))


def load(w: WorkerSide, req: str, toks: np.ndarray, pages: list[list[int]]) -> set[int]:
    """A step's load: start, every layer's wait (as the attention layers do), errors."""
    w.start_load_kv(KVTierConnectorMetadata(loads=[TransferSpec(req, None, toks, 0, pages)]))
    for name in w.layer_index:
        w.wait_for_layer_load(name)
    return w.take_load_errors()


def pages_equal(kv: dict[str, Any], a: list[list[int]], b: list[list[int]]) -> bool:
    ia = [p for r in a for p in r]
    ib = [p for r in b for p in r]
    return all(torch.equal(c[ia], c[ib]) for c in kv.values())


def gate_layer(monkeypatch: pytest.MonkeyPatch, layer: int) -> threading.Event:
    """Hold the copy of ``layer`` back until the returned event is set."""
    gate = threading.Event()
    original = transfers.LoadBatch._load_layer

    def gated(self: Any, i: int, stream: Any) -> None:
        if i == layer:
            assert gate.wait(WAIT_S)
        original(self, i, stream)

    monkeypatch.setattr(transfers.LoadBatch, "_load_layer", gated)
    return gate


def test_save_then_pipelined_load_is_exact(daemon: DaemonProcess,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    kv = caches(1)
    w = worker(daemon, "exact", kv)
    toks, src = tokens(1, 4), rows(1, 4)
    save(w, "a", toks, src, save_id=7)
    finished(w, "a")
    meta = w.worker_meta()
    assert meta is not None and meta.saves_done == {7: 1}
    assert meta.counters["saved_blocks"] == 4
    dst = rows(21, 4)
    for c in kv.values():
        c[[p for r in dst for p in r]] = 0
    gate = gate_layer(monkeypatch, LAYERS - 1)
    w.start_load_kv(KVTierConnectorMetadata(loads=[TransferSpec("b", None, toks, 0, dst)]))
    names = list(w.layer_index)
    w.wait_for_layer_load(names[0])        # returns while the last layer is held back
    assert w.pipeline is not None
    trace = w.pipeline.last_trace
    assert trace is not None and trace.ready_at[-1] is None
    first = [p for r in dst for p in r]
    assert torch.equal(kv[names[0]][first], kv[names[0]][[p for r in src for p in r]])
    gate.set()
    for name in names:
        w.wait_for_layer_load(name)
    assert w.take_load_errors() == set()
    assert trace.waited_at[0] < trace.ready_at[-1]  # type: ignore[operator]
    assert all(r <= t for r, t in zip(trace.ready_at, trace.waited_at, strict=True))  # type: ignore[operator]
    assert pages_equal(kv, src, dst)
    assert w.worker_meta().counters["loaded_blocks"] == 4
    w.shutdown()


def test_a_finished_request_keeps_its_pages_until_its_saves_are_over(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    original = transfers.SaveRequest.copy

    def gated(self: Any, stream: Any) -> None:
        assert gate.wait(WAIT_S)
        original(self, stream)

    monkeypatch.setattr(transfers.SaveRequest, "copy", gated)
    w = worker(daemon, "delay", caches(2))
    save(w, "r", tokens(2, 2), rows(1, 2), save_id=1)
    sending, _ = w.get_finished({"r"})     # vLLM: "r" finished; its save is in flight
    assert "r" not in sending
    assert w.get_finished(set())[0] == set()
    gate.set()
    finished(w, "r")                      # reported once the save committed
    assert w.get_finished(set())[0] == set()   # and only once
    w.shutdown()


def test_saves_beyond_the_bound_are_dropped_and_counted(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    original = transfers.SaveRequest.copy

    def gated(self: Any, stream: Any) -> None:
        assert gate.wait(WAIT_S)
        original(self, stream)

    monkeypatch.setattr(transfers.SaveRequest, "copy", gated)
    w = worker(daemon, "bound", caches(3), max_inflight_save_bytes=2 * LAYOUT.block_bytes)
    save(w, "x", tokens(3, 2), rows(1, 2), save_id=1)      # fills the bound
    save(w, "y", tokens(4, 1), rows(11, 1), save_id=2)     # dropped, no error, no wait
    meta = w.worker_meta()
    assert meta is not None and meta.saves_done == {2: 1}
    assert meta.counters == {"dropped_saves": 1, "dropped_save_bytes": LAYOUT.block_bytes}
    assert "y" in w.get_finished({"y"})[0]                  # nothing in flight for "y"
    gate.set()
    finished(w, "x")
    assert w.pipeline is not None and w.pipeline.save_stats.dropped == 1
    w.shutdown()


def test_a_producer_save_larger_than_the_bound_goes_in_pieces(
        daemon: DaemonProcess) -> None:
    """A kv_producer never drops a save for room: one larger than the bound on saves in
    flight (a long prompt of a large model) is saved in pieces that fit it, each with its
    place in the chain. It used to be dropped, the consumer then recomputing it all."""
    cfg = ConnectorConfig.from_extra({"socket_path": str(daemon.socket), "tokens_per_block": TPB,
                                      "model_id": "pieces",
                                      "max_inflight_save_bytes": LAYOUT.block_bytes},
                                     block_size=PAGE, default_model_id="pieces",
                                     role="kv_producer")
    w = WorkerSide(cfg, LAYOUT, PAGE, 0, 1)
    w.register_kv_caches(caches(12))
    toks = tokens(12, 3)
    save(w, "p", toks, rows(1, 3), save_id=5)   # a producer's save returns once it is over
    meta = w.worker_meta()
    assert meta is not None and "dropped_saves" not in meta.counters
    reader = worker(daemon, "pieces", caches(13))
    assert load(reader, "q", toks, rows(21, 3)) == set()   # all three blocks load
    w.shutdown()
    reader.shutdown()


def test_a_lease_that_expires_during_the_load_is_a_load_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_daemon(tmp_path / "ttl", KVTIER_DAEMON_LEASE_TTL_S="0.2")
    try:
        kv = caches(4)
        w = worker(d, "ttl", kv)
        toks, src = tokens(5, 3), rows(1, 3)
        save(w, "s", toks, src, save_id=1)
        finished(w, "s")
        gate = gate_layer(monkeypatch, LAYERS - 1)
        dst = rows(21, 3)
        w.start_load_kv(KVTierConnectorMetadata(loads=[TransferSpec("l", None, toks, 0,
                                                                    dst)]))
        deadline = time.monotonic() + WAIT_S
        while d.stats()["requests"]["lease_expired"] < 1:   # the daemon's sweep took it
            assert time.monotonic() < deadline, "lease never expired"
            time.sleep(0.05)
        gate.set()
        for name in w.layer_index:
            w.wait_for_layer_load(name)
        assert w.take_load_errors() == {p for r in dst for p in r}
        w.shutdown()
    finally:
        d.kill()


def test_a_device_worker_loads_from_hbm_views(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    opened = install_client_fake(monkeypatch)
    d = make_daemon(tmp_path / "hbm", program=DAEMON_PROGRAM, **daemon_env(),
                    KVTIER_HBM_ENABLED="1", KVTIER_HBM_BYTES="4MiB")
    try:
        kv = caches(5)
        w = worker(d, "hbm", kv, device_loads=True)
        toks, src, dst = tokens(6, 3), rows(1, 3), rows(21, 3)
        save(w, "s", toks, src, save_id=1)
        finished(w, "s")
        assert d.stats()["tiers"]["hbm"]["blocks"] == 0
        assert load(w, "l", toks, dst) == set()
        assert pages_equal(kv, src, dst)
        assert opened and all(isinstance(m, FakeHbmMapping) for m in opened)
        hbm = d.stats()["tiers"]["hbm"]     # the get placed them there and read them there
        assert hbm["blocks"] == 3 and hbm["bytes_read"] == 3 * LAYOUT.block_bytes
        w.shutdown()
    finally:
        d.kill()


def test_the_arena_is_mapped_and_registered_once_per_process(daemon: DaemonProcess) -> None:
    calls: list[tuple[int, int]] = []

    def register(address: int, nbytes: int) -> bool:
        calls.append((address, nbytes))
        return True

    kv = caches(6)
    w = worker(daemon, "register", kv, register=register)
    toks, src = tokens(7, 2), rows(1, 2)
    save(w, "s", toks, src, save_id=1)           # saver thread: its own connection
    finished(w, "s")
    assert load(w, "l", toks, rows(21, 2)) == set()   # loader thread: another one
    assert len(calls) == 1
    (reg,) = w.arenas.registrations.values()
    assert reg.ok and reg.nbytes == calls[0][1] and reg.address == calls[0][0]
    assert len(w.arenas.arenas) == 1
    w.shutdown()


def test_a_restarted_daemon_s_arena_replaces_the_old_mapping(tmp_path: Path) -> None:
    d = make_daemon(tmp_path / "restart")
    try:
        kv = caches(7)
        w = worker(d, "restart", kv, reconnect_min_s=0.01, reconnect_max_s=0.05)
        save(w, "a", tokens(8, 1), rows(1, 1), save_id=1)
        finished(w, "a")
        (first,) = w.arenas.arenas
        d.kill()
        d.start()
        deadline = time.monotonic() + WAIT_S
        i = 2
        while first in w.arenas.arenas:     # saves fail, then reconnect to the new daemon
            assert time.monotonic() < deadline, "never reconnected"
            save(w, f"r{i}", tokens(8 + i, 1), rows(1, 1), save_id=i)
            finished(w, f"r{i}")
            i += 1
        assert len(w.arenas.arenas) == 1     # the dead daemon's arena is unmapped
        w.shutdown()
    finally:
        d.kill()


def test_retries_against_a_stalled_daemon_hold_the_engine_briefly(
        tmp_path: Path) -> None:
    """A daemon stopped (SIGSTOP) still accepts connections and never greets: after the
    first timeout, each reconnect try holds the engine's thread for a short hello, not a
    whole request timeout (once 1 s per try here, 2 s with the defaults); once it runs
    again, hits come back."""
    import os
    import signal

    from kvtier.connectors.vllm.link import RECONNECT_HELLO_S, DaemonLink

    from kvtier.keys import block_keys

    d = make_daemon(tmp_path / "stalled")
    cfg = ConnectorConfig.from_extra({"socket_path": str(d.socket), "tokens_per_block": TPB,
                                      "model_id": "stall", "timeout_s": 1.0,
                                      "reconnect_min_s": 0.05, "reconnect_max_s": 0.05},
                                     block_size=PAGE, default_model_id="stall")
    w = WorkerSide(cfg, LAYOUT, PAGE, 0, 1)
    w.register_kv_caches(caches(14))
    toks = tokens(14, 2)
    save(w, "a", toks, rows(1, 2), save_id=1)
    finished(w, "a")
    link = DaemonLink(cfg, LAYOUT, name="scheduler")
    ns = link.namespace(None, 0)
    keys = block_keys(ns, toks)
    assert link.lookup(ns, keys) == 2
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        assert link.lookup(ns, keys) == 0   # the first request waits its timeout
        tries = []
        for _ in range(3):
            time.sleep(0.06)   # past the backoff: a reconnect try
            t0 = time.monotonic()
            assert link.lookup(ns, keys) == 0
            tries.append(time.monotonic() - t0)
        assert max(tries) < RECONNECT_HELLO_S + 0.5, tries
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + WAIT_S
    while link.lookup(ns, keys) != 2:
        assert time.monotonic() < deadline, "hits did not come back after SIGCONT"
        time.sleep(0.06)
    link.close()
    w.shutdown()
    d.kill()


def test_a_get_lease_lost_with_a_restarted_daemon_is_a_load_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon restarts while a load copies: its get lease went with the old connection,
    so the release fails and the pages are a load error (what was read is unconfirmed).
    The release used to be retried on a fresh connection, where the lease, already marked
    ended, released nothing and reported success: the pages counted as good KV. The next
    step's loads still reach the new daemon (the lost connection is not backed off)."""
    d = make_daemon(tmp_path / "lost-get")
    try:
        kv = caches(15)
        w = worker(d, "lostget", kv, reconnect_min_s=60.0, reconnect_max_s=60.0)
        toks, src, dst = tokens(15, 2), rows(1, 2), rows(21, 2)
        save(w, "s", toks, src, save_id=1)
        finished(w, "s")
        gate = gate_layer(monkeypatch, LAYERS - 1)
        w.start_load_kv(KVTierConnectorMetadata(loads=[TransferSpec("l", None, toks, 0,
                                                                    dst)]))
        w.wait_for_layer_load(next(iter(w.layer_index)))   # the lease is open: copying
        d.kill()
        d.start()
        gate.set()
        for name in w.layer_index:
            w.wait_for_layer_load(name)
        assert w.take_load_errors() == {p for r in dst for p in r}
        monkeypatch.undo()
        save(w, "s2", toks, src, save_id=2)        # the saver reconnects to the new daemon
        finished(w, "s2")
        assert load(w, "l2", toks, rows(41, 2)) == set()   # and so does the loader
        w.shutdown()
    finally:
        d.kill()


def test_a_put_lease_lost_with_a_restarted_daemon_does_not_hold_off_later_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon restarts while a save copies: the commit fails on the lease's dead
    connection. It used to be retried on a fresh connection, failed again there (the lease
    still pointed at the dead one), and the link then closed the fresh connection and
    backed off, so the saves of the next steps were skipped until the backoff ran out."""
    d = make_daemon(tmp_path / "lost-put")
    try:
        gate, copying = threading.Event(), threading.Event()
        original = transfers.SaveRequest.copy

        def gated(self: Any, stream: Any) -> None:
            copying.set()
            assert gate.wait(WAIT_S)
            original(self, stream)

        monkeypatch.setattr(transfers.SaveRequest, "copy", gated)
        kv = caches(16)
        w = worker(d, "lostput", kv, reconnect_min_s=60.0, reconnect_max_s=60.0)
        save(w, "warm", tokens(16, 1), rows(1, 1), save_id=1)   # the saver's connection
        gate.set()
        finished(w, "warm")
        gate.clear()
        copying.clear()
        toks = tokens(17, 2)
        save(w, "a", toks, rows(1, 2), save_id=2)
        assert copying.wait(WAIT_S)        # the put lease is open: copying
        d.kill()
        d.start()
        gate.set()
        finished(w, "a")                   # its commit failed: nothing stored
        monkeypatch.undo()
        save(w, "b", toks, rows(1, 2), save_id=3)    # the next step's save gets through
        finished(w, "b")
        meta = w.worker_meta()
        assert meta is not None and meta.counters.get("saved_blocks") == 1 + 2, meta
        assert load(w, "l", toks, rows(21, 2)) == set()
        w.shutdown()
    finally:
        d.kill()


def test_a_failed_load_into_pages_a_preempted_request_gave_up_is_not_its_own(
        daemon: DaemonProcess) -> None:
    """Request A loads its prefix, is preempted, and its pages go to B, whose load into
    them fails. Only B must forget the blocks it could not load: A's finished load, still
    remembered, used to match B's pages too, so A forgot blocks kvtier holds and saved
    them again once resumed (from its own pages: redundant, never wrong KV)."""
    from kvtier.connectors.vllm.scheduler import SchedulerSide

    from tests.support.vllm_fakes import fake as NS

    w = worker(daemon, "stale", caches(18))
    ta, tb = tokens(18, 3), tokens(19, 3)
    save(w, "sa", ta, rows(1, 3), save_id=1)
    save(w, "sb", tb, rows(11, 3), save_id=2)
    finished(w, "sa")
    finished(w, "sb")
    cfg = ConnectorConfig.from_extra({"socket_path": str(daemon.socket), "tokens_per_block": TPB,
                                      "model_id": "stale"},
                                     block_size=PAGE, default_model_id="stale")
    sched = SchedulerSide(cfg, LAYOUT, PAGE, 1)

    def request(rid: str, toks: np.ndarray) -> Any:
        ids = [int(t) for t in toks] + [7] * 10          # 3 full blocks and a partial one
        return NS(request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids),
                  num_tokens=len(ids), cache_salt=None, mm_features=None,
                  prompt_embeds=None, lora_request=None)

    def admit(req: Any, pages: list[int]) -> None:
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        assert n == 3 * TPB
        sched.update_state_after_alloc(req, NS(get_block_ids=lambda: (pages,)), n)

    def step(new: tuple[str, list[int]] | None = None, preempted: tuple[str, ...] = (),
             resumed: tuple[str, list[int]] | None = None) -> KVTierConnectorMetadata:
        cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                    num_computed_tokens=[])
        scheduled = {}
        new_reqs = []
        if new is not None:
            new_reqs.append(NS(req_id=new[0], block_ids=(new[1],), num_computed_tokens=3 * TPB))
            scheduled[new[0]] = 10
        if resumed is not None:      # recomputed from scratch: no load
            cached = NS(req_ids=[resumed[0]], new_block_ids=[(resumed[1],)],
                        resumed_req_ids={resumed[0]}, num_computed_tokens=[0])
            scheduled[resumed[0]] = 3 * TPB + 10
        return sched.build_connector_meta(NS(
            preempted_req_ids=list(preempted), num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached))

    def outcome(invalid: set[int]) -> None:
        sched.update_connector_output(NS(kv_connector_worker_meta=None,
                                         invalid_block_ids=invalid))

    a, b = request("A", ta), request("B", tb)
    pages = list(range(1, 8))
    admit(a, pages)
    assert [s.req_id for s in step(new=("A", pages)).loads] == ["A"]
    outcome(set())                                     # A's load succeeded
    admit(b, pages)                                    # A preempted: B gets its pages
    assert [s.req_id for s in step(new=("B", pages), preempted=("A",)).loads] == ["B"]
    outcome({pages[2], pages[3]})                      # B's block 1 failed to load
    assert sched._states["B"].known_blocks == 1
    assert sched._states["A"].known_blocks == 3        # A's blocks are still in kvtier
    meta = step(resumed=("A", list(range(20, 27))))
    assert [s for s in meta.saves if s.req_id == "A"] == []   # nothing saved again
    sched.shutdown()
    w.shutdown()


def test_the_scheduler_times_only_steps_without_kvtier_waits_and_reports_going_idle(
        daemon: DaemonProcess) -> None:
    """A step with a synchronous load (or a producer's synchronous saves) timed the wait as
    prefill, so recomputing looked slower than it is; the engine's gauges kept their last
    value once it went idle (no step reports it), and the context-length percentiles the
    doctor and the dashboard read were never sent."""
    from kvtier.connectors.vllm.scheduler import SchedulerSide

    from tests.support.vllm_fakes import fake as NS

    w = worker(daemon, "gauges", caches(21))
    ta = tokens(21, 3)
    save(w, "sa", ta, rows(1, 3), save_id=1)
    finished(w, "sa")
    cfg = ConnectorConfig.from_extra({"socket_path": str(daemon.socket), "tokens_per_block": TPB,
                                      "model_id": "gauges"},
                                     block_size=PAGE, default_model_id="gauges")
    sched = SchedulerSide(cfg, LAYOUT, PAGE, 1)

    def request(rid: str, toks: np.ndarray, extra: int) -> Any:
        ids = [int(t) for t in toks] + [7] * extra
        return NS(request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids),
                  num_tokens=len(ids), cache_salt=None, mm_features=None,
                  prompt_embeds=None, lora_request=None)

    def step(rid: str, pages: list[int], computed: int, n: int,
             preempted: tuple[str, ...] = ()) -> KVTierConnectorMetadata:
        cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                    num_computed_tokens=[])
        meta = sched.build_connector_meta(NS(
            preempted_req_ids=list(preempted), num_scheduled_tokens={rid: n},
            total_num_scheduled_tokens=n,
            scheduled_new_reqs=[NS(req_id=rid, block_ids=(pages,),
                                   num_computed_tokens=computed)],
            scheduled_cached_reqs=cached))
        sched.update_connector_output(NS(kv_connector_worker_meta=None, invalid_block_ids=set()))
        return meta

    def connector_stats() -> dict[str, Any]:
        return daemon.stats()["connector"]

    a = request("A", ta, 10)
    n, _ = sched.get_num_new_matched_tokens(a, 0)
    assert n == 3 * TPB
    sched.update_state_after_alloc(a, NS(get_block_ids=lambda: (list(range(1, 8)),)), n)
    assert step("A", list(range(1, 8)), 3 * TPB, 10).loads      # a synchronous load
    assert sched.recompute.warmup_steps == 1                     # not timed
    b = request("B", tokens(22, 3), 300)
    assert sched.get_num_new_matched_tokens(b, 0)[0] == 0
    sched.update_state_after_alloc(b, NS(get_block_ids=lambda: ([],)), 0)
    assert step("B", list(range(10, 26)), 0, 3 * TPB + 300).saves   # B saves its blocks
    assert sched.recompute.warmup_steps == 0                     # a clean prefill: timed
    # a step that preempts B waits for B's saves in the workers first: not timed either
    c = request("C", tokens(23, 3), 300)
    assert sched.get_num_new_matched_tokens(c, 0)[0] == 0
    sched.update_state_after_alloc(c, NS(get_block_ids=lambda: ([],)), 0)
    measured = sched.recompute.measured_steps
    step("C", list(range(30, 46)), 0, 3 * TPB + 300, preempted=("B",))
    assert sched.recompute.measured_steps == measured
    sched.request_finished(c)

    sched._maybe_report(force=True)
    deadline = time.monotonic() + 10
    while connector_stats().get("context_tokens_p99") is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    got = connector_stats()
    assert got["running"] == 2
    assert got["context_tokens_p50"] == (len(a.all_token_ids) + len(b.all_token_ids)) / 2
    assert len(a.all_token_ids) < got["context_tokens_p99"] <= len(b.all_token_ids)
    sched._last_report = time.monotonic()                       # within the interval ...
    sched.request_finished(a)
    sched.request_finished(b)                                   # ... yet idle is told at once
    while connector_stats()["running"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert connector_stats()["context_tokens_p50"] == 0
    sched.shutdown()
    w.shutdown()


class RecordingStream:
    """Stands in for the async-load thread's CUDA stream (no GPU here): records what the
    worker asks of it, so the order of the copies, the sync and the release is checked."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def wait_event(self, fence: Any) -> None:
        self.events.append(f"wait {fence}")

    def synchronize(self) -> None:
        self.events.append("synchronize")


def test_an_async_load_on_a_gpu_finishes_its_copies_before_it_releases_its_leases(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the copies of an asynchronous load are enqueued on a stream; the leases
    were released right after enqueueing them, so the daemon could reuse a slot a kernel
    was still reading. Now the load waits for the compute queued before it, and its stream
    is synchronized before the first release (the stream seam is recorded here; the
    tokens are still checked byte for byte on the CPU copy)."""
    import contextlib

    kv = caches(30)
    w = worker(daemon, "async-gpu-order", kv)
    toks, src, dst = tokens(31, 2), rows(1, 2), rows(31, 2)
    save(w, "s", toks, src, save_id=1)
    finished(w, "s")
    events: list[str] = []
    stream = RecordingStream(events)
    monkeypatch.setattr(w.async_loads, "stream", lambda caches: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    assert w.pipeline is not None
    monkeypatch.setattr(w.pipeline.streams, "compute_fence", lambda: "compute-fence")
    original_load, original_release = transfers.LoadBatch.load_layer, transfers._release

    def load_layer(self: Any, layer: int, s: Any) -> None:
        assert s is stream
        events.append(f"load {layer}")
        original_load(self, layer, None)   # the bytes move on the CPU as before

    def release(lease: Any, copy_s: Any, client: Any) -> None:
        events.append("release")
        original_release(lease, copy_s, client)

    monkeypatch.setattr(transfers.LoadBatch, "load_layer", load_layer)
    monkeypatch.setattr(transfers, "_release", release)
    w.start_load_kv(KVTierConnectorMetadata(async_loads=[TransferSpec("a", None, toks, 0,
                                                                      dst)]))
    deadline = time.monotonic() + WAIT_S
    done: set[str] = set()
    while "a" not in done:
        assert time.monotonic() < deadline
        time.sleep(0.005)
        done = w.get_finished(set())[1]
    assert events == ["wait compute-fence", *(f"load {i}" for i in range(LAYERS)),
                      "synchronize", "release"], events
    assert w.take_load_errors() == set() and pages_equal(kv, src, dst)
    assert daemon.stats()["requests"]["get_blocks"] >= 2
    w.shutdown()


LAYOUT_NOWHERE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                          tokens_per_block=64)


def _worker_nowhere(tmp_path: Path) -> WorkerSide:
    cfg = ConnectorConfig.from_extra({"socket_path": str(tmp_path / "none.sock"),
                                      "tokens_per_block": 64, "model_id": "m"},
                                     block_size=32, default_model_id="m")
    return WorkerSide(cfg, LAYOUT_NOWHERE, 32, 0, 1)


def test_workers_name_namespaces_as_the_scheduler_side_does(tmp_path: Path) -> None:
    """Each side derives the model id and layout in its own process, from a config vLLM's
    model loading may change in the workers only (an EAGLE engine's split in two: saves
    under one namespace, lookups under another). The scheduler side's names travel in the
    step's metadata and every link of the worker, its threads' too, takes them."""

    from kvtier.keys import Namespace

    layout = LAYOUT_NOWHERE
    worker = _worker_nowhere(tmp_path)
    try:
        links = []
        t = threading.Thread(target=lambda: links.append(worker._thread_link("-save")))
        t.start()
        t.join()
        worker.adopt(KVTierConnectorMetadata())               # nothing named: unchanged
        assert worker.link.namespace(None, 0) == Namespace("m", layout, 0, 1, None)
        worker.adopt(KVTierConnectorMetadata(model_id="m#w=abc", kv_format="x:fp8"))
        want = Namespace("m#w=abc", KVLayout(num_layers=2, num_kv_heads=2, head_dim=32,
                                             dtype="float32", tokens_per_block=64,
                                             kv_format="x:fp8"), 0, 1, "s")
        assert worker.link.namespace("s", 0) == links[0].namespace("s", 0) == want
        assert worker.config.model_id == "m#w=abc"
        assert worker.layout.block_bytes == layout.block_bytes
    finally:
        worker.shutdown()


def test_the_stale_pages_the_scheduler_names_are_the_step_s_load_errors(
        tmp_path: Path) -> None:
    """The scheduler side names the bad pages a request of this step counts computed (a
    sharer of a page whose load failed): the worker reports them as the step's load
    errors, the only way vLLM rolls that request back; unreported, it decoded on the
    failed page's zeroed KV (wrong tokens)."""
    w = _worker_nowhere(tmp_path)
    try:
        w.start_load_kv(KVTierConnectorMetadata(stale_pages=[3, 4], step=0))
        assert w.take_load_errors() == {3, 4}
        assert w.take_load_errors() == set()
    finally:
        w.shutdown()


def test_an_async_load_s_failed_pages_are_load_errors(tmp_path: Path) -> None:
    """An asynchronous load that failed on some pages ends (finished_recving) with those
    pages in the load errors, so that vLLM recomputes them rather than using them."""
    w = _worker_nowhere(tmp_path)
    try:
        fut: Future[set[int]] = Future()
        fut.set_result({7, 8})
        w.async_loads.running["A"] = fut
        assert w.get_finished(set()) == (set(), {"A"})
        assert w.take_load_errors() == {7, 8}
    finally:
        w.shutdown()
