"""How the daemon builds its tiers: one factory per tier, replaceable as a whole.

``Daemon(cfg, parts=DaemonParts(hbm=...))`` is the one seam for building a tier another
way; the CPU test suite passes a factory whose HBM pool lives in host memory
(tests/support/fake_hbm.py) instead of patching this module. Each factory takes the whole
config and returns an opened tier (the redis tier is started by the daemon: its start is
asynchronous); the daemon closes what it was given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.config import Config
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.tiers.hbm import HbmTier
    from kvtier.tiers.nvme import NvmeTier
    from kvtier.tiers.redis import RedisTier

log = logging.getLogger("kvtier.daemon")


def make_nvme(cfg: Config) -> NvmeTier:
    """The nvme tier under ``cfg.nvme_path`` with the configured I/O backend."""
    from kvtier.backoff import BackoffPolicy
    from kvtier.tiers.nvme import NvmeTier
    from kvtier.tiers.nvme.backends import make_frame_io, select_nvme_backend

    nvme = cfg.nvme
    choice = select_nvme_backend(nvme.backend)   # ConfigError when kvikio is forced in vain
    log.info("nvme I/O backend: %s (%s)", choice.name, choice.reason)
    return NvmeTier(cfg.nvme_path, nvme.bytes, direct=nvme.direct,
                    io_threads=nvme.io_threads,
                    io=make_frame_io(choice, threads=nvme.io_threads),
                    backoff=BackoffPolicy(nvme.backoff_min_s, nvme.backoff_max_s))


def open_hbm(cfg: Config, *, pool_factory: Any = None, why: str = "") -> HbmTier:
    """An opened HBM tier of ``hbm.bytes`` on ``hbm.device`` whose pool ``pool_factory``
    allocates (default: the CUDA pool); ``why`` says where the pool lives, for the log."""
    from kvtier.tiers.hbm import HbmTier

    hbm = cfg.hbm
    if hbm.bytes <= 0:
        raise ConfigError("hbm.enabled needs hbm.bytes > 0 (the device pool size, e.g. 8GiB)")
    tier = HbmTier(hbm.bytes, device=hbm.device, pool_factory=pool_factory)
    tier.open()
    log.info("hbm tier: %d bytes on CUDA device %d (%s)", tier.capacity_bytes, hbm.device, why)
    return tier


def make_hbm(cfg: Config) -> HbmTier:
    """The HBM pool (hbm.enabled): a clear ConfigError when this host cannot have one.

    The store places blocks in it for clients that ask for device placement, and the
    handshake hands its CUDA IPC handle to every client. UNTESTED ON HARDWARE: the CPU
    tests pass a factory with a host-memory pool instead (tests/support/fake_hbm.py).
    """
    from kvtier.tiers.hbm import hbm_available

    if cfg.hbm.bytes <= 0:
        raise ConfigError("hbm.enabled needs hbm.bytes > 0 (the device pool size, e.g. 8GiB)")
    ok, why = hbm_available(cfg.hbm.device)
    if not ok:
        raise ConfigError(f"hbm.enabled needs a CUDA device: {why}; set hbm.enabled = false "
                          "or run on a GPU host with the [gpu] extra installed")
    return open_hbm(cfg, why=why)


def make_redis(cfg: Config) -> RedisTier:
    """The redis tier, not started yet (the daemon awaits its ``start``)."""
    from kvtier.tiers.redis import RedisTier

    return RedisTier(cfg.redis)


@dataclass(frozen=True, slots=True)
class DaemonParts:
    """The tier factories a daemon uses; replace one to build that tier another way."""

    hbm: Callable[[Config], HbmTier] = make_hbm
    nvme: Callable[[Config], NvmeTier] = make_nvme
    redis: Callable[[Config], RedisTier] = make_redis
