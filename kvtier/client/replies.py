"""Checks of what the daemon replies, before the client acts on it.

The client maps the arena read-write and turns the offsets a reply names into views it
copies from or into: an offset outside the arena, two views that overlap, or more slots
than keys asked for would read another block's bytes as this one's, or write over them,
and report success. A daemon bug, a version mismatch or something else listening on the
socket must not do that: every such reply is a ``ProtocolError`` before any view exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import ProtocolError
from kvtier.tiers.aligned import PAGE, round_up


def slot_offsets(offsets: Any, n_keys: int, nbytes: int, arena_size: int, *,
                 exact: bool) -> list[int | None]:
    """``offsets`` of a put (``exact``: one per key, None where a key needs no write) or a
    get (the leading hits: at most one per key), checked: ints naming ``nbytes`` inside
    the arena, at slot boundaries (the arena hands out whole pages), no two overlapping."""
    if not isinstance(offsets, list):
        raise ProtocolError(f"daemon sent offsets of type {type(offsets).__name__}")
    if len(offsets) > n_keys or (exact and len(offsets) != n_keys):
        raise ProtocolError(f"daemon sent {len(offsets)} offsets for {n_keys} keys")
    placed = [off for off in offsets if off is not None]
    if len(placed) != len(offsets) and not exact:
        raise ProtocolError("daemon sent a get offset of None")
    if not placed:
        return offsets
    if any(type(off) is not int for off in placed):
        raise ProtocolError("daemon sent an offset that is not an int")
    if any(not -(1 << 62) < off < 1 << 62 for off in placed):
        raise ProtocolError(f"daemon sent an offset outside the arena of {arena_size} bytes")
    starts = np.sort(np.asarray(placed, dtype=np.int64))
    if starts[0] < 0 or int(starts[-1]) + nbytes > arena_size:
        raise ProtocolError(f"daemon sent an offset outside the arena of {arena_size} bytes")
    if np.any(starts % PAGE):
        raise ProtocolError("daemon sent an offset that is not at a slot boundary")
    if len(starts) > 1 and int(np.diff(starts).min()) < round_up(nbytes):
        raise ProtocolError("daemon sent overlapping slots")
    return offsets


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``hits`` leading blocks are present; ``tiers[i]`` says where block i was found.

    ``bandwidth``: bytes/s at which a block of each tier reached clients recently, as
    measured by the daemon (empty from daemons that do not report it, and for tiers not
    yet measured).
    """

    hits: int
    tiers: list[str]
    bandwidth: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_reply(cls, reply: dict[str, Any], n_keys: int) -> LookupResult:
        """The one place a LookupResult is built from a ``lookup`` reply (about
        ``n_keys`` keys: a count outside 0..n_keys is a ProtocolError)."""
        hits, tiers = lookup_hits(reply, n_keys)
        bandwidth = reply.get("bandwidth")
        rates = ({str(k): float(v) for k, v in bandwidth.items()
                  if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}
                 if isinstance(bandwidth, dict) else {})
        return cls(hits, tiers, rates)


def lookup_hits(reply: dict[str, Any], n_keys: int) -> tuple[int, list[str]]:
    """A lookup reply's hit count and tiers, checked against the keys asked about."""
    hits, tiers = reply.get("hits"), reply.get("tiers")
    if type(hits) is not int or not 0 <= hits <= n_keys:
        raise ProtocolError(f"daemon sent {hits!r} hits for {n_keys} keys")
    if not isinstance(tiers, list) or len(tiers) != hits or \
            not all(isinstance(t, str) for t in tiers):
        raise ProtocolError(f"daemon sent tiers {_short(tiers)} for {hits} hits")
    return hits, tiers


def _short(value: Sequence[Any] | Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
