"""The connector API that engines call: sync (``connect``) and asyncio (``connect_async``).

KV bytes move through the daemon's shared-memory arena; the socket carries only small
msgpack control frames. Every operation is written once, as a sans-I/O generator that
yields requests and receives replies; the sync client drives it with a blocking socket
and the async client with asyncio streams, so the two can never drift apart.

Two-phase under the hood: ``prepare_put`` hands out write-locked arena slots (a lease
with a TTL) that the caller fills and then commits; ``prepare_get`` hands out read-locked
slots that the caller releases. A crashed client's leases expire; a closed connection's
leases are released at once. A lease that expired before its release or commit raises
``LeaseExpired`` there: ``get`` never returns bytes read under an expired lease, a put
stores nothing. See docs/client-api.md ("Leases and their TTL").

Device placement (GPU engines, daemons with an HBM pool): a client made with
``connect(..., device=True)``, or a ``prepare_get(..., prefer_device=True)`` call, maps the
daemon's HBM pool (CUDA IPC handle from the handshake) the first time it needs it, and its
get leases may hand out device views (``GetLease.devices[i] == "hbm"``) that the engine
copies device-to-device. Other clients never import cupy and see no change.
UNTESTED ON HARDWARE: the device path runs on the CPU tests only through a fake mapping.

Modules: ``ops`` (every operation as a sans-I/O generator, ``LookupResult``), ``leases``
(put and get leases, their rules written once), ``sync`` (``KVTierClient``, ``connect``),
``aio`` (``AsyncKVTierClient``, ``connect_async``).
"""

from kvtier.client.aio import AsyncKVTierClient, connect_async
from kvtier.client.leases import AsyncGetLease, AsyncPutLease, GetLease, PutLease
from kvtier.client.ops import PUT_BATCH, LookupResult
from kvtier.client.sync import KVTierClient, connect
from kvtier.prefix import PrefixLocality

__all__ = [
    "PUT_BATCH", "AsyncGetLease", "AsyncKVTierClient", "AsyncPutLease", "GetLease",
    "KVTierClient", "LookupResult", "PrefixLocality", "PutLease", "connect", "connect_async",
]
