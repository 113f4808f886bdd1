"""The block store: a coordinator (``TieredStore``) over one residency per tier.

- ``coordinator``: the public API the daemon's control server calls (lookup, put, get,
  delete, leases, drain, stats) and the wiring of the parts below;
- ``cpu``, ``nvme``, ``hbm``: the residencies: each owns its tier's fields of a block's
  state and its eviction policy;
- ``reads``: lookup and the readable prefix; ``promoter``: lower tier -> cpu, waiting as
  ``kvtier.policy.prefetch`` says; ``demotion``: cpu victim -> nvme -> redis;
- ``transfers``: byte movement dispatched by (source, destination) tier;
- ``namespaces``: who may see which block, and with which layout; ``leasing``: leases;
- ``blocks``: the index's lifecycle (orphans); ``alloc``: allocate-with-eviction;
- ``recovery``: warm restart and the commit journal; ``stats``: counters; ``ports``: the
  Protocols of the tiers and hooks the store uses.
"""

from kvtier.store.coordinator import TieredStore
from kvtier.store.cpu import CpuResidency
from kvtier.store.hbm import HbmEntry, HbmPlacement
from kvtier.store.stats import LookupResult, PrefetchCounters, RequestCounters

__all__ = ["CpuResidency", "HbmEntry", "HbmPlacement", "LookupResult",
           "PrefetchCounters", "RequestCounters", "TieredStore"]
