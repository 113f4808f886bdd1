"""GPU engines: one arena mapping per process, registered with CUDA once.

Every ``kvtier.client`` connection maps the daemon's shared-memory arena; a worker has a
few (its loader and saver threads each own one, and reconnects make new ones). For the
copies between the arena and GPU pages to be asynchronous DMA on the connector's streams
rather than pageable copies, the mapping must be registered with ``cudaHostRegister``,
which is slow (it pins every page: peers report seconds per 8 GiB) and must not be undone
while a copy may run. So each process keeps the first verified mapping of each arena file
(the client's own, checked with fstat on the descriptor the daemon passed: never a second
open by path), hands it to every client it opens, and registers it once, logging how long
it took. Arenas are told apart by file identity, not path: a restarted daemon may reuse
the path of its arena for a new file.

The registration function is injectable (``ArenaRegistry(register=...)``): the CPU tests
pass a recorder through the same seam the GPU path uses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.arena_mapping import ArenaMapping

logger = logging.getLogger("kvtier.connectors.vllm")

Register = Callable[[int, int], bool]
"""``register(address, nbytes) -> registered?`` (``cudaHostRegister`` on GPU hosts)."""
GIB = 2**30


ArenaKey = tuple[str, tuple[int, int]]
"""(path, (st_dev, st_ino)): one arena file."""


@dataclass(slots=True)
class Registration:
    """One arena registered with the device: where, how big, how long it took."""

    path: str
    address: int
    nbytes: int
    seconds: float
    ok: bool

    @property
    def seconds_per_8gib(self) -> float:
        return self.seconds * 8 * GIB / self.nbytes if self.nbytes else 0.0


@dataclass(slots=True)
class ArenaRegistry:
    """Shares one mapping per arena path among a process's clients; registers it once
    when ``register`` is set (GPU engines)."""

    register: Register | None = None
    arenas: dict[ArenaKey, ArenaMapping] = field(default_factory=dict)
    registrations: dict[ArenaKey, Registration] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def adopt(self, client: Any) -> None:
        """Make ``client`` read and write through the process-wide mapping of its arena."""
        ops = getattr(client, "_ops", None)
        path = getattr(ops, "arena_path", None)
        own = getattr(ops, "arena", None)
        if ops is None or path is None or not isinstance(own, ArenaMapping):
            return
        key: ArenaKey = (path, own.identity)
        with self._lock:
            shared = self.arenas.get(key)
            if shared is None or shared.size != own.size:
                self._retire_others(key)
                own.keep_mapped = True        # the first verified mapping becomes shared
                shared = self.arenas[key] = own
            if self.register is not None and key not in self.registrations:
                self.registrations[key] = self._register(path, shared)
        if shared is not own:
            ops.arena = shared
            own.close()

    def _retire_others(self, key: ArenaKey) -> None:
        """A new arena (the daemon restarted): unmap the old ones, whose files are gone and
        would otherwise keep their shared memory. A registered one stays mapped (a copy of
        the dead daemon's blocks may still be in flight on a stream); logged."""
        for old in [k for k in self.arenas if k != key]:
            reg = self.registrations.get(old)
            if reg is not None and reg.ok:
                logger.info("kvtier: keeping the registered mapping of the old arena %s "
                            "(%.2f GiB) until exit", old[0], reg.nbytes / GIB)
                continue
            mapping = self.arenas.pop(old)
            mapping.keep_mapped = False
            mapping.close()                   # unmaps once no view is alive

    def _register(self, path: str, arena: ArenaMapping) -> Registration:
        assert self.register is not None
        address = int(arena.buf.ctypes.data)
        t0 = time.perf_counter()
        try:
            ok = bool(self.register(address, arena.size))
        except Exception as exc:  # never take the engine down: stay on pageable copies
            logger.warning("kvtier: registering the arena with CUDA failed (%s); copies stay "
                           "pageable", exc)
            ok = False
        reg = Registration(path, address, arena.size, time.perf_counter() - t0, ok)
        if ok:
            logger.info("kvtier: registered the arena %s (%.2f GiB) with CUDA in %.3f s "
                        "(%.2f s per 8 GiB)", path, reg.nbytes / GIB, reg.seconds,
                        reg.seconds_per_8gib)
        return reg


def cuda_register(address: int, nbytes: int) -> bool:
    """``cudaHostRegister`` (portable, mapped) through cupy; False without a GPU."""
    from kvtier.kernels.cuda_stream import register_host_memory

    return register_host_memory(address, nbytes)
