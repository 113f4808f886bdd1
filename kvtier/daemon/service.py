"""Daemon lifecycle: set up tiers and servers, serve, drain on SIGTERM, clean up.

Phases (each bounded): preflight (socket directory, data directory, HTTP port, shared
memory: each failure one line naming the path and the fix, kvtier.daemon.preflight),
setup (arena, adopted after a crash when its journal says what it holds; index rebuild
from nvme and the adopted arena; redis connect in the background), start (control socket,
HTTP), serve, drain (stop accepting, let in-flight requests finish, persist cpu-only
blocks to nvme, flush redis), cleanup in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.config import Config, default_runtime_dir
from kvtier.daemon.control import ControlServer
from kvtier.daemon.http import HttpServer, bind_http
from kvtier.daemon.limits import Limits
from kvtier.daemon.metrics import Metrics, admission_stats
from kvtier.daemon.preflight import check_shm_space, check_writable_dir, setup_error
from kvtier.errors import ConfigError
from kvtier.explain import MissLog, salt_id
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena, journal_path, remove_stale_arenas, stable_arena_name
from kvtier.tiers.arena_journal import read_journal
from kvtier.trust import claim_socket_path, prepare_socket_dir

log = logging.getLogger("kvtier.daemon")


class Daemon:
    """One kvtier daemon per node."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
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
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._http_sockets: list[socket.socket] = []   # bound at preflight, served by http

    # -- setup ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Set everything up; StartupError (one line naming the path and the fix) for any
        failure of the environment, the checks first so they fail before any slow setup."""
        try:
            await self._setup()
        except OSError as exc:
            raise setup_error(exc) from exc

    def _preflight(self) -> tuple[str | None, Path | None]:
        """The cheap checks (kvtier.daemon.preflight, kvtier.trust) before building tiers;
        returns the stable arena name and path when warm restart is on (else None)."""
        cfg = self.cfg
        prepare_socket_dir(cfg.daemon.socket, default_dir=default_runtime_dir())
        claim_socket_path(cfg.daemon.socket)
        check_writable_dir(cfg.daemon.data_dir, "data directory", "--data-dir")
        if cfg.nvme.enabled and cfg.nvme.bytes > 0:
            check_writable_dir(cfg.nvme_path, "nvme directory", "--nvme-path")
        self._http_sockets = bind_http(cfg.http.host, cfg.http.port)
        if not cfg.cpu.shm_dir.is_dir():
            raise ConfigError(f"shared-memory directory {cfg.cpu.shm_dir} does not exist: set "
                              "cpu.shm_dir to a tmpfs directory such as /dev/shm")
        name = stable_arena_name(cfg.daemon.data_dir) if cfg.cpu.warm_restart else None
        own = cfg.cpu.shm_dir / name if name else None
        for stale in remove_stale_arenas(cfg.cpu.shm_dir, keep=own,
                                         need_bytes=cfg.cpu.bytes):
            log.info("removed stale arena %s", stale)
        check_shm_space(cfg.cpu.shm_dir, cfg.cpu.bytes, reusable=own)
        return name, own

    async def _setup(self) -> None:
        cfg = self.cfg
        sock = cfg.daemon.socket
        name, own = self._preflight()
        state = read_journal(journal_path(own)) if own is not None else None
        self.arena = Arena(cfg.cpu.bytes, shm_dir=cfg.cpu.shm_dir,
                           slab_bytes=cfg.cpu.slab_bytes, prefault=cfg.cpu.prefault,
                           name=name, adopt=state is not None)
        if cfg.hbm.enabled:
            self.hbm = self._make_hbm()
        if cfg.nvme.enabled and cfg.nvme.bytes > 0:
            self.nvme = self._make_nvme()
        if cfg.redis.enabled:
            from kvtier.tiers.redis import RedisTier

            self.redis = RedisTier(cfg.redis)
            await self.redis.start()
        self.store = self._make_store()
        self.explain = MissLog(policies={
            "cpu": getattr(self.store.cpu_policy, "name", ""),
            "nvme": getattr(self.store.nvme_policy, "name", "")}, redis_tier=self.redis is not None)
        self.store.explain = self.explain
        journal = journal_path(self.arena.path) if self.arena.path == own else None
        recovered = await self.store.recover(state, journal=journal)
        rebuilt = recovered.nvme_blocks
        self.adopted_blocks = recovered.adopted_blocks
        if rebuilt:
            log.info("rebuilt index from nvme: %d blocks", rebuilt)
        self.metrics = Metrics(self.stats)
        self.control = ControlServer(
            self.store, sock, max_frame=cfg.daemon.max_frame_bytes,
            max_inflight=cfg.daemon.max_inflight_per_conn, arena_path=str(self.arena.path),
            arena_size=self.arena.size, observe=self.metrics.observe,
            hbm=self.hbm.handshake_info() if self.hbm is not None else None,
            open_arena=self.arena.open_for_client, limits=Limits.from_config(cfg.daemon))
        self.control.stats_provider = self.stats
        await self.control.start()
        self.http = HttpServer(cfg.http.host, cfg.http.port, self.metrics, self.stats,
                               cfg.to_dict, cfg.http.admin_token,
                               recent=self.recent_lookups, sockets=self._http_sockets,
                               prefix=self.control.prefix)
        await self.http.start()
        self._sweeper = asyncio.ensure_future(self._sweep())
        self.rebuilt_blocks = rebuilt

    def _make_nvme(self) -> Any:
        from kvtier.backoff import BackoffPolicy
        from kvtier.tiers.nvme import NvmeTier
        from kvtier.tiers.nvme_backend import make_frame_io, select_nvme_backend

        nvme = self.cfg.nvme
        choice = select_nvme_backend(nvme.backend)   # ConfigError when kvikio is forced in vain
        log.info("nvme I/O backend: %s (%s)", choice.name, choice.reason)
        return NvmeTier(self.cfg.nvme_path, nvme.bytes, direct=nvme.direct,
                        io_threads=nvme.io_threads,
                        io=make_frame_io(choice, threads=nvme.io_threads),
                        backoff=BackoffPolicy(nvme.backoff_min_s, nvme.backoff_max_s))

    def _make_hbm(self) -> Any:
        """The HBM pool (hbm.enabled): a clear ConfigError when this host cannot have one.

        The store places blocks in it for clients that ask for device placement, and the
        handshake hands its CUDA IPC handle to every client. UNTESTED ON HARDWARE: the CPU
        tests run this with a host-memory fake pool (tests/support/fake_hbm.py).
        """
        from kvtier.tiers.hbm import HbmTier, hbm_available

        hbm = self.cfg.hbm
        if hbm.bytes <= 0:
            raise ConfigError("hbm.enabled needs hbm.bytes > 0 (the device pool size, e.g. "
                              "8GiB)")
        ok, why = hbm_available(hbm.device)
        if not ok:
            raise ConfigError(f"hbm.enabled needs a CUDA device: {why}; set hbm.enabled = false "
                              "or run on a GPU host with the [gpu] extra installed")
        tier = HbmTier(hbm.bytes, device=hbm.device)
        tier.open()
        log.info("hbm tier: %d bytes on CUDA device %d (%s)", tier.capacity_bytes, hbm.device,
                 why)
        return tier

    def _make_store(self) -> TieredStore:
        cfg = self.cfg
        assert self.arena is not None
        kwargs: dict[str, Any] = {}
        try:
            from kvtier.policy.factory import build_policies  # cost policy wiring

            kwargs.update(build_policies(cfg))
        except ImportError:
            kwargs["eviction"] = cfg.policy.eviction if cfg.policy.eviction != "cost" else "lru"
        return TieredStore(
            self.arena, nvme=self.nvme, redis=self.redis, hbm=self.hbm,
            lease_ttl_s=cfg.daemon.lease_ttl_s,
            prefetch_wait=cfg.policy.prefetch_wait,
            prefetch_ms_per_block=cfg.policy.prefetch_timeout_ms_per_block,
            redis_write_through=cfg.redis.write_through,
            redis_lookup_budget_s=cfg.redis.lookup_budget_s,
            max_namespaces=cfg.daemon.max_namespaces, **kwargs)

    async def _sweep(self) -> None:
        """Take back expired leases every ``daemon.lease_sweep_s`` (a late commit or release
        is refused at its deadline whatever the period; the sweep frees the memory)."""
        while True:
            await asyncio.sleep(self.cfg.daemon.lease_sweep_s)
            if self.store is not None:
                n = self.store.expire_leases()
                if n:
                    log.warning("expired %d leases (client hung or crashed)", n)

    # -- serve / stop --------------------------------------------------------------------
    def banner(self) -> str:
        assert self.http is not None and self.arena is not None
        tiers = f"cpu {self.arena.size / 2**30:.2f} GiB (shm {self.arena.path})"
        if self.hbm is not None:
            tiers = (f"hbm {self.hbm.capacity_bytes / 2**30:.2f} GiB (cuda device "
                     f"{self.cfg.hbm.device}), " + tiers)
        if self.nvme is not None:
            tiers += (f", nvme {self.cfg.nvme.bytes / 2**30:.2f} GiB at {self.cfg.nvme_path} "
                      f"({self.nvme.backend})")
        if self.redis is not None:
            tiers += f", redis {self.cfg.redis.url.split('@')[-1]}"
        return (f"kvtier {__version__} serving (pid {os.getpid()})\n"
                f"  socket: {self.cfg.daemon.socket}\n"
                f"  http:   http://{self.cfg.http.host}:{self.http.port}  "
                f"(/metrics /v1/stats /healthz)\n"
                f"  tiers:  {tiers}\n"
                f"  policy: {self.cfg.policy.eviction}; rebuilt {self.rebuilt_blocks} blocks "
                f"from nvme, adopted {self.adopted_blocks} from the arena")

    def request_stop(self) -> None:
        self._stop.set()

    async def serve_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        await self._stop.wait()

    async def stop(self) -> None:
        """Graceful drain bounded by daemon.drain_timeout_s, then cleanup in reverse order."""
        deadline = time.monotonic() + self.cfg.daemon.drain_timeout_s
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.control is not None:
            await self.control.stop_accepting()
            await self.control.close_connections(max(0.1, (deadline - time.monotonic()) / 2))
        if self.store is not None:
            try:
                saved = await asyncio.wait_for(self.store.drain(deadline),
                                               max(0.1, deadline - time.monotonic()))
                log.info("drain: persisted %d cpu-only blocks to nvme", saved)
            except asyncio.TimeoutError:
                log.warning("drain timed out; some cpu-only blocks were not persisted")
        if self.http is not None:
            await self.http.stop()
        else:   # the start failed after binding the HTTP port: release it
            for http_socket in self._http_sockets:
                http_socket.close()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.redis.close(), 2.0)
        if self.nvme is not None:
            self.nvme.close()
        if self.arena is not None:
            self.arena.close()
        if self.hbm is not None:
            self.hbm.close()

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        assert self.store is not None
        out: dict[str, Any] = {"version": 1}
        out["daemon"] = {
            "pid": os.getpid(), "version": __version__,
            "uptime_s": round(time.time() - self.started, 3),
            "socket": str(self.cfg.daemon.socket),
            "clients": len(self.control.connections) if self.control else 0,
            "rejected_peers": self.control.rejected_peers if self.control else 0,
            "protocol_errors": self.control.protocol_errors if self.control else 0,
        }
        if self.control is not None:
            out["daemon"].update(self.control.limit_stats())
        out.update(self.store.stats())   # tiers.hbm first when the daemon has a pool
        shadows = getattr(self.store.observer, "snapshot", None)
        if callable(shadows):  # adaptive policy: mode and miss-ratio curve per tier
            out.setdefault("policy", {})["tiers"] = shadows()
        out["connector"] = self.control.engine_summary() if self.control else {}
        if self.control is not None:
            schemes: dict[str, int] = {}
            for conn in self.control.connections.values():
                scheme = getattr(conn, "key_scheme", "") or "unknown"
                schemes[scheme] = schemes.get(scheme, 0) + 1
            out["daemon"]["key_schemes"] = schemes
        out["admission"] = admission_stats(self.store.admission,
                                           self.cfg.nvme.write_budget_bytes_per_s)
        if self.explain is not None:
            out["explain"] = self.explain.stats()
        return out

    def recent_lookups(self, limit: int, misses_only: bool) -> list[dict[str, Any]]:
        """Recent lookups with their first-miss reason, newest first (/v1/lookups/recent)."""
        if self.explain is None or self.store is None:
            return []
        names = {d: {"model_id": e.namespace.model_id,
                     "salt_id": salt_id(e.namespace.cache_salt), "tp_rank": e.namespace.tp_rank}
                 for d, e in self.store.namespaces.items()}
        return self.explain.recent(limit, misses_only=misses_only, namespaces=names)


async def run_daemon(cfg: Config, *, ready: Any = None) -> None:
    """Start, print where to find the daemon, serve until SIGTERM/SIGINT, drain."""
    daemon = Daemon(cfg)
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
