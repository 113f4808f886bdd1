"""Daemon lifecycle: set up tiers and servers, serve, drain on SIGTERM, clean up.

Phases (each bounded): preflight (socket directory, data directory, HTTP port, shared
memory: each failure one line naming the path and the fix, kvtier.daemon.preflight),
setup (arena, adopted after a crash when its journal says what it holds; tiers from the
factories of ``DaemonParts``; index rebuild from nvme and the adopted arena; redis connect
in the background), start (control socket, HTTP), serve, stop.

Every resource registers its teardown on one ``AsyncExitStack`` right after it is made, so
a failed start and a stop undo the same steps in reverse order: signal handlers, lease
sweeper, control socket (stop accepting, let in-flight requests finish), store drain
(persist cpu-only blocks to nvme), redis flush, nvme, hbm, arena, HTTP. One deadline
(``daemon.drain_timeout_s``, from the moment the stop begins) bounds every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import Config, default_runtime_dir
from kvtier.daemon import describe
from kvtier.daemon.control import ControlServer
from kvtier.daemon.descriptors import connections_that_fit
from kvtier.daemon.gc_guard import GcGuard
from kvtier.daemon.http import HttpServer, bind_http
from kvtier.daemon.limits import Limits
from kvtier.daemon.loop_lag import LoopLag
from kvtier.daemon.metrics import Metrics
from kvtier.daemon.parts import DaemonParts
from kvtier.daemon.preflight import (
    check_dir_path,
    check_shm_space,
    check_writable_dir,
    setup_error,
    shm_dir_problem,
    shm_side_bytes,
)
from kvtier.errors import ConfigError
from kvtier.explain import MissLog
from kvtier.policy.factory import build_policies
from kvtier.presence import PresenceFilter
from kvtier.socket_path import claim_socket_path, lock_socket_path, prepare_socket_dir
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena, journal_path, remove_stale_arenas, stable_arena_name
from kvtier.tiers.journal_replay import read_journal
from kvtier.tiers.journal_run import begin_run, last_run

log = logging.getLogger("kvtier.daemon")


@dataclass(slots=True)
class Deadline:
    """One shutdown deadline shared by every teardown step (``daemon.drain_timeout_s``)."""

    at: float

    def left(self, floor: float = 0.1) -> float:
        """Seconds left, at least ``floor`` (a step past the deadline still gets a moment
        to release what it holds)."""
        return max(floor, self.at - time.monotonic())


class Daemon:
    """One kvtier daemon per node; ``parts`` builds its tiers (default: the real ones)."""

    def __init__(self, cfg: Config, parts: DaemonParts | None = None) -> None:
        self.cfg = cfg
        self.parts = parts if parts is not None else DaemonParts()
        self.started = time.time()
        self.arena: Arena | None = None
        self.nvme: Any = None
        self.hbm: Any = None
        self.redis: Any = None
        self.store: TieredStore | None = None
        self.control: ControlServer | None = None
        self.http: HttpServer | None = None
        self.metrics: Metrics | None = None
        self.explain: MissLog | None = None
        self.gc: GcGuard | None = None
        self.loop_lag: LoopLag | None = None
        self.rebuilt_blocks = 0
        self.adopted_blocks = 0
        self._recovered = False   # the store's recovery ran: only then is there a drain
        self._max_connections = cfg.daemon.max_connections   # what the open-file limit fits
        self._stop = asyncio.Event()
        self._stack = contextlib.AsyncExitStack()
        self._deadline = Deadline(math.inf)

    # -- setup ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Set everything up; StartupError (one line naming the path and the fix) for any
        failure of the environment, the checks first so they fail before any slow setup.
        The caller calls ``stop`` in every case (it undoes what the failed start made)."""
        try:
            await self._setup()
        except OSError as exc:
            raise setup_error(exc) from exc

    def _preflight(self) -> tuple[str | None, Path | None]:
        """The cheap checks (kvtier.daemon.preflight, kvtier.trust) before building tiers;
        binds the HTTP port (its sockets are released at stop); returns the stable arena
        name and path when warm restart is on (else None)."""
        cfg = self.cfg
        prepare_socket_dir(cfg.daemon.socket, default_dir=default_runtime_dir())
        self._stack.callback(os.close, lock_socket_path(cfg.daemon.socket))
        claim_socket_path(cfg.daemon.socket)
        self.metrics = Metrics(self.stats)
        self.http = HttpServer(cfg.http.host, cfg.http.port, self.metrics, self.stats,
                               cfg.to_dict, cfg.http.admin_token, recent=self.recent_lookups,
                               sockets=bind_http(cfg.http.host, cfg.http.port),
                               read_timeout_s=cfg.daemon.read_timeout_s,
                               max_connections=cfg.http.max_connections)
        self._stack.push_async_callback(self.http.stop)
        # before any file is opened (kvtier.daemon.descriptors)
        self._max_connections = connections_that_fit(cfg)
        problem = shm_dir_problem(cfg.cpu.shm_dir, os.getuid())
        if problem is not None:
            raise ConfigError(problem)
        # before the arena's name, which resolves the data directory's path (a symbolic
        # link loop there is one line, not a traceback); creates nothing
        check_dir_path(cfg.daemon.data_dir, "data directory", "daemon.data_dir", "--data-dir")
        name = stable_arena_name(cfg.daemon.data_dir) if cfg.cpu.warm_restart else None
        own = cfg.cpu.shm_dir / name if name else None
        side = shm_side_bytes(warm_restart=cfg.cpu.warm_restart)
        for stale in remove_stale_arenas(cfg.cpu.shm_dir, keep=own,
                                         need_bytes=cfg.cpu.bytes + side):
            log.info("removed stale arena %s", stale)
        check_shm_space(cfg.cpu.shm_dir, cfg.cpu.bytes, reusable=own, side_bytes=side)
        # last: these create the directories, which a start refused above should not leave
        check_writable_dir(cfg.daemon.data_dir, "data directory", "--data-dir",
                           "daemon.data_dir")
        if cfg.nvme.enabled and cfg.nvme.bytes > 0:
            check_writable_dir(cfg.nvme_path, "nvme directory", "--nvme-path", "nvme.path")
        return name, own

    async def _setup(self) -> None:
        cfg, stack, parts = self.cfg, self._stack, self.parts
        name, own = self._preflight()
        if cfg.daemon.gc_freeze:   # first: recovery indexes every adopted block
            self.gc = GcGuard(cfg.daemon.gc_full_s, quiet_s=cfg.daemon.gc_quiet_s,
                              quiet_for=self._quiet_for)
            self.gc.start()
            stack.callback(self.gc.stop)
        state = read_journal(journal_path(own)) if own is not None else None
        last = last_run(cfg.daemon.data_dir)
        # an arena another run left (a start in between went on without it) is not adopted:
        # made anew, so its stale bytes and the clients still mapping it are gone with it
        self.arena = Arena(cfg.cpu.bytes, shm_dir=cfg.cpu.shm_dir,
                           slab_bytes=cfg.cpu.slab_bytes, prefault=cfg.cpu.prefault,
                           name=name, adopt=state is not None and state.run == last)
        stack.callback(self._close_arena)
        if cfg.hbm.enabled:
            self.hbm = self._make_hbm()
            stack.callback(self.hbm.close)
        if cfg.nvme.enabled and cfg.nvme.bytes > 0:
            self.nvme = self._make_nvme()
            stack.callback(self.nvme.close)
        if cfg.redis.enabled:
            self.redis = parts.redis(cfg)
            stack.push_async_callback(self._close_redis, self.redis)
            await self.redis.start()
        self.store = store = self._make_store()
        if self.redis is not None:   # shuffle codecs: each block's element width
            self.redis.use_layouts(store.ns.layout)
        self.explain = MissLog(policies={
            "cpu": getattr(store.cpu_policy, "name", ""),
            "nvme": getattr(store.nvme_policy, "name", "")}, redis_tier=self.redis is not None)
        store.explain = self.explain
        stack.push_async_callback(self._drain_store, store)
        presence = self._make_presence(Path(f"{self.arena.path}.presence"))
        if presence is not None:   # every key entering or leaving the index, recovered too
            stack.callback(presence.close)
            store.index.presence = presence
        journal = journal_path(self.arena.path) if self.arena.path == own else None
        recovered = await store.recover(
            state, journal=journal, last_run=last,
            begin_run=functools.partial(begin_run, cfg.daemon.data_dir))
        self._recovered = True
        self.rebuilt_blocks, self.adopted_blocks = recovered.nvme_blocks, recovered.adopted_blocks
        if self.rebuilt_blocks:
            log.info("rebuilt index from nvme: %d blocks", self.rebuilt_blocks)
        assert self.metrics is not None and self.http is not None
        self.control = control = ControlServer(
            store, cfg.daemon.socket, max_frame=cfg.daemon.max_frame_bytes,
            max_inflight=cfg.daemon.max_inflight_per_conn, arena_path=str(self.arena.path),
            arena_size=self.arena.size, observe=self.metrics.observe,
            hbm=self.hbm.handshake_info() if self.hbm is not None else None,
            open_arena=self.arena.open_for_client,
            limits=dataclasses.replace(Limits.from_config(cfg.daemon, self.arena.size),
                                       max_connections=self._max_connections))
        control.stats_provider = self.stats
        # a "no" from the filter is final only without a Redis tier to look further in
        if presence is not None:
            control.greeter.presence = (presence.announce(exact=self.redis is None),
                                        presence.open_for_client)
        stack.push_async_callback(self._close_control, control)
        await control.start()
        self.http.prefix = control.prefix   # POST /v1/prefix (kvtier.daemon.prefix)
        await self.http.start()
        sweeper = asyncio.ensure_future(self._sweep(store))
        stack.callback(sweeper.cancel)
        self.loop_lag = LoopLag(self.metrics.loop_lag.observe)
        self.loop_lag.start()
        stack.callback(self.loop_lag.stop)

    def _quiet_for(self) -> float:
        """Seconds since the last request on the control socket or the prefix endpoint."""
        last = max(self.control.last_request if self.control is not None else 0.0,
                   self.http.last_request if self.http is not None else 0.0)
        return time.monotonic() - last

    @staticmethod
    def _make_presence(path: Path) -> PresenceFilter | None:
        """The presence filter (kvtier.presence), or None when its file cannot be made (a
        name taken in a shared /dev/shm): it only spares clients round trips, so the
        daemon serves without it, every lookup asked."""
        try:
            return PresenceFilter.create(path)
        except OSError as exc:
            fix = ("free space in the shared-memory directory (cpu.shm_dir) or lower "
                   "cpu.bytes" if exc.errno in (errno.ENOSPC, errno.ENOMEM)
                   else "remove that file to get it back")
            log.warning("no presence filter at %s (%s): clients ask the daemon for every "
                        "lookup; %s", path, exc, fix)
            return None

    def _make_hbm(self) -> Any:
        """The HBM tier from ``parts.hbm`` (default: the CUDA pool, kvtier.daemon.parts)."""
        return self.parts.hbm(self.cfg)

    def _make_nvme(self) -> Any:
        """The nvme tier from ``parts.nvme`` (default: the configured I/O backend)."""
        return self.parts.nvme(self.cfg)

    def _make_store(self) -> TieredStore:
        """The store over the tiers made so far, with the configured policies."""
        cfg = self.cfg
        assert self.arena is not None
        return TieredStore(
            self.arena, nvme=self.nvme, redis=self.redis, hbm=self.hbm,
            lease_ttl_s=cfg.daemon.lease_ttl_s,
            prefetch_wait=cfg.policy.prefetch_wait,
            prefetch_ms_per_block=cfg.policy.prefetch_timeout_ms_per_block,
            redis_write_through=cfg.redis.write_through,
            redis_lookup_budget_s=cfg.redis.lookup_budget_s,
            max_namespaces=cfg.daemon.max_namespaces, **build_policies(cfg))

    async def _sweep(self, store: TieredStore) -> None:
        """Take back expired leases every ``daemon.lease_sweep_s`` (a late commit or release
        is refused at its deadline whatever the period; the sweep frees the memory)."""
        while True:
            await asyncio.sleep(self.cfg.daemon.lease_sweep_s)
            n = store.expire_leases()
            if n:
                log.warning("expired %d leases (client hung or crashed)", n)
            store.retry_orphans()
            if self.arena is not None and self.arena.journal is not None:
                self.arena.journal.tick()   # a stopped journal resumes while idle too

    # -- teardown steps (run by the exit stack, bounded by the one deadline) --------------
    async def _close_control(self, control: ControlServer) -> None:
        await control.stop_accepting()
        await control.close_connections(self._deadline.left() / 2)

    def _close_arena(self) -> None:
        """Unlinked, unless this start adopted a crashed daemon's arena and was refused
        before recovering it: the next start adopts it (a cold one erased the nvme frames
        behind the lost cpu heads, durable ones included; found by review)."""
        assert self.arena is not None
        self.arena.close(unlink=self._recovered or not self.arena.adopted)

    async def _drain_store(self, store: TieredStore) -> None:
        if not self._recovered:   # refused before it held anything (the nvme lock, say):
            return                # no drain to log for a daemon that never served
        try:
            saved = await asyncio.wait_for(store.drain(self._deadline.at),
                                           self._deadline.left())
            log.info("drain: persisted %d cpu-only blocks to nvme", saved)
        except asyncio.TimeoutError:
            log.warning("drain timed out; some cpu-only blocks were not persisted")

    async def _close_redis(self, redis: Any) -> None:
        """Flush queued writes within what is left of the deadline; never fails the stop."""
        left = self._deadline.left()
        try:
            await asyncio.wait_for(redis.close(timeout=left), left + 0.5)
        except Exception as exc:   # a dead Redis must not stop the cleanup
            log.warning("redis close: %s", exc)

    # -- serve / stop --------------------------------------------------------------------
    def banner(self) -> str:
        assert self.http is not None and self.arena is not None
        return describe.banner(self.cfg, self.arena, self.http.port, hbm=self.hbm,
                               nvme=self.nvme, redis=self.redis, rebuilt=self.rebuilt_blocks,
                               adopted=self.adopted_blocks)

    def request_stop(self) -> None:
        self._stop.set()

    async def serve_until_signal(self) -> None:
        """Serve until a stop signal (``catch_stop_signals``) or ``request_stop``."""
        await self._stop.wait()

    async def stop(self) -> None:
        """Undo everything set up so far, in reverse order, within ``drain_timeout_s``."""
        self._deadline = Deadline(time.monotonic() + self.cfg.daemon.drain_timeout_s)
        await self._stack.aclose()

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        assert self.store is not None
        return describe.stats_document(
            self.cfg, self.store, self.started, control=self.control, gc=self.gc,
            loop_lag=self.loop_lag, explain=self.explain, http=self.http)

    def recent_lookups(self, limit: int, misses_only: bool) -> list[dict[str, Any]]:
        """Recent lookups with their first-miss reason, newest first (/v1/lookups/recent)."""
        return describe.recent_lookups(self.explain, self.store, limit, misses_only)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Each asks for the one graceful stop (SIGHUP: a closed terminal, a supervisor's stop):
whenever it comes, during the start, while serving or during the drain, the arena, its
journal, the presence filter and the socket are cleaned up as at any stop."""


@contextlib.contextmanager
def catch_stop_signals(daemon: Daemon) -> Iterator[None]:
    """Route the stop signals to ``daemon.request_stop`` for the daemon's whole life (a
    second signal during the drain changes nothing: the drain is bounded anyway)."""
    loop = asyncio.get_running_loop()
    caught = []
    for sig in STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, daemon.request_stop)
        except (NotImplementedError, RuntimeError):
            continue
        caught.append(sig)
    try:
        yield
    finally:
        for sig in caught:
            loop.remove_signal_handler(sig)


async def run_daemon(cfg: Config, *, ready: Any = None, parts: DaemonParts | None = None) -> None:
    """Start, print where to find the daemon, serve until SIGTERM/SIGINT, drain."""
    daemon = Daemon(cfg, parts)
    with catch_stop_signals(daemon):
        try:
            await daemon.start()
            print(daemon.banner(), flush=True)
            if ready is not None:
                ready(daemon)
            await daemon.serve_until_signal()
            print("kvtier: draining", flush=True)
        finally:
            await daemon.stop()
    print("kvtier: stopped", flush=True)
