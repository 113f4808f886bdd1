"""Checks of what the daemon replies, before the client acts on it.

The client maps the arena read-write and turns the offsets a reply names into views it
copies from or into: an offset outside the arena, two views that overlap, or more slots
than keys asked for would read another block's bytes as this one's, or write over them,
and report success. A daemon bug, a version mismatch or something else listening on the
socket must not do that: every such reply is a ``ProtocolError`` before any view exists.
So is any field the client reads that is missing, of the wrong type or out of range (a
count of more blocks than keys asked), and a frame that would decode into more objects
than the request justifies (``ReplyBound``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import numpy as np

from kvtier.errors import KVTierError, ProtocolError, brief
from kvtier.keys import KEY_BYTES
from kvtier.prefix import PrefixLocality
from kvtier.protocol import unpack_body
from kvtier.tiers.aligned import PAGE, round_up


def slot_offsets(offsets: Any, n_keys: int, nbytes: int, arena_size: int, *,
                 exact: bool, where: str = "arena") -> list[int | None]:
    """``offsets`` of a put (``exact``: one per key, None where a key needs no write) or a
    get (the leading hits: at most one per key), checked: ints naming ``nbytes`` inside
    the arena (``where``: or the HBM pool, the same pages), at slot boundaries (the arena
    hands out whole pages), no two overlapping."""
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
        raise ProtocolError(f"daemon sent an offset outside the {where} of {arena_size} bytes")
    starts = np.sort(np.asarray(placed, dtype=np.int64))
    if starts[0] < 0 or int(starts[-1]) + nbytes > arena_size:
        raise ProtocolError(f"daemon sent an offset outside the {where} of {arena_size} bytes")
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
    """A reply value for an error message, cut before it is rendered (``brief``): the repr
    of a whole 64 MiB value in a bad reply would be built first."""
    return brief(value, 80)


MAX_REPLY = 64 * 2**20
"""Largest reply frame either client accepts (bytes)."""
REPLY_ITEMS = 4096
"""Entries of one array or map of a reply not sized by the request: a stats reply's
largest container has a few dozen (measured: 23, ``/v1/stats`` of a daemon with traffic)."""
REPLY_ENTRIES = 16384
"""Entries of all arrays and maps of a reply together, beyond those the request sizes:
a stats reply has a few hundred (measured: 234), the others a handful."""
PER_KEY_ENTRIES = 2
"""A reply carries at most two entries per key asked: ``get_prepare`` an offset and a
device, ``lookup`` a tier, ``put_prepare`` an offset."""
PER_PROMPT_ENTRIES = 32
"""A ``prefix_locality`` result per prompt: a map of 7 fields and ``tier_blocks`` (one per
tier, 4 tiers), two containers: 13 entries, with room for fields added later."""
P = ParamSpec("P")
Y = TypeVar("Y")
S = TypeVar("S")
R = TypeVar("R")
REPLY_ERRORS: tuple[type[Exception], ...] = (KeyError, TypeError, ValueError, IndexError)
"""What reading a malformed reply raises where a check was missed: a ``ProtocolError``
at the clients' ``_run`` (``unreadable``), never an untyped error in the caller."""


@dataclass(frozen=True, slots=True)
class ReplyBound:
    """The most a reply to one request may hold once decoded (``unpack_body``'s
    ``max_items`` and ``max_entries``): sized by the keys and prompts the request names, so
    a reply costs the client no more than its own request justifies. A frame of 1-byte
    empty arrays decoded unbounded cost 0.6 GB and 7 s per 8 MiB (found by review)."""

    items: int
    entries: int

    @classmethod
    def of(cls, req: dict[str, Any]) -> ReplyBound:
        """The bound of the reply to ``req`` (O(1): the keys travel as one blob)."""
        keys, lengths = req.get("keys"), req.get("lengths")
        n = len(keys) // KEY_BYTES if isinstance(keys, bytes) else 0
        prompts = len(lengths) if isinstance(lengths, list) else 1
        if n <= SMALL_KEYS and prompts <= SMALL_PROMPTS:
            return SMALL_REQUEST
        return cls(max(REPLY_ITEMS, n, prompts),
                   REPLY_ENTRIES + PER_KEY_ENTRIES * n + PER_PROMPT_ENTRIES * prompts)

    def wider(self, other: ReplyBound) -> ReplyBound:
        """A bound that fits the replies of both requests."""
        if other.items <= self.items and other.entries <= self.entries:
            return self
        return ReplyBound(max(self.items, other.items), max(self.entries, other.entries))


SMALL_KEYS = REPLY_ITEMS
SMALL_PROMPTS = 256   # the daemon's cap on ``lengths`` (kvtier.daemon.prefix_input)
SMALL_REQUEST = ReplyBound(REPLY_ITEMS, REPLY_ENTRIES + PER_KEY_ENTRIES * SMALL_KEYS
                           + PER_PROMPT_ENTRIES * SMALL_PROMPTS)
"""The bound of every request of at most ``SMALL_KEYS`` keys and ``SMALL_PROMPTS``
prompts (requests without keys included): one object, no work per call."""


def decode_reply(body: bytes, bound: ReplyBound) -> dict[str, Any]:
    """One reply frame's body, decoded within ``bound``; ProtocolError past it."""
    try:
        return unpack_body(body, MAX_REPLY, bound.items, bound.entries)
    except ProtocolError as exc:
        raise ProtocolError(f"daemon reply refused (the client decodes at most "
                            f"{bound.items} entries per array or map, {bound.entries} in "
                            f"all, for this request): {exc}") from None


def unreadable(exc: Exception) -> ProtocolError:
    """The ``ProtocolError`` for an untyped error raised while reading a reply (one of
    ``REPLY_ERRORS``; the safety net behind the checks below)."""
    return ProtocolError(f"daemon sent a reply the client cannot read "
                         f"({type(exc).__name__}: {_short(str(exc))})")


def reads_reply(fn: Callable[P, Generator[Y, S, R]]) -> Callable[P, Generator[Y, S, R]]:
    """An op that reads replies, with ``REPLY_ERRORS`` (not KVTierErrors) raised meanwhile
    as a ProtocolError: the safety net behind the checks, for a malformed field they
    missed (found by review). Not for the ops that copy the caller's buffers (``put``,
    ``get``): their errors are the caller's and propagate as they are."""
    @functools.wraps(fn)
    def reading(*args: P.args, **kwargs: P.kwargs) -> Generator[Y, S, R]:
        try:
            return (yield from fn(*args, **kwargs))
        except REPLY_ERRORS as exc:
            if isinstance(exc, KVTierError):
                raise
            raise unreadable(exc) from None
    return reading


def lease_of(reply: dict[str, Any]) -> int:
    """The ``lease`` a prepare reply names: an int (found by review: a missing one was a
    KeyError)."""
    lease = reply.get("lease")
    if type(lease) is not int:
        raise ProtocolError(f"daemon sent lease {_short(lease)}")
    return lease


def count_of(reply: dict[str, Any], name: str, most: int | None, default: Any = None) -> int:
    """A count a reply carries (``stored``, ``deleted``, ``redis_visible``): an int in
    0..``most`` (the keys asked about; None: no upper bound known). ``default``: the value
    when absent (None: required). A put that reported 10**6 or -7 blocks stored for 2 keys
    was believed (found by review)."""
    value = reply.get(name, default)
    if type(value) is not int or value < 0 or (most is not None and value > most):
        raise ProtocolError(f"daemon sent {name}={_short(value)}"
                            + ("" if most is None else f" for {most} keys"))
    return value


def stats_of(reply: dict[str, Any]) -> dict[str, Any]:
    """The ``stats`` map of a stats reply (found by review: a missing one was a KeyError)."""
    stats = reply.get("stats")
    if not isinstance(stats, dict):
        raise ProtocolError(f"daemon sent stats {_short(stats)}")
    return stats


def devices_of(reply: dict[str, Any], n_offsets: int) -> list[str]:
    """The ``devices`` of a get_prepare reply: one of "cpu"/"hbm" per offset (absent: all
    cpu). ``devices: 5`` was a TypeError (found by review)."""
    devices = reply.get("devices")
    if devices is None or devices == []:
        return ["cpu"] * n_offsets
    if not isinstance(devices, list) or len(devices) != n_offsets or \
            any(d != "cpu" and d != "hbm" for d in devices):
        raise ProtocolError(f"get_prepare reply has devices {_short(devices)} for "
                            f"{n_offsets} offsets")
    return devices


def get_slots(reply: dict[str, Any], n_keys: int, nbytes: int, arena_size: int,
              hbm_size: int | None) -> tuple[list[int], list[str]]:
    """The offsets and devices of a get_prepare reply, checked before any view: cpu
    offsets against the arena, hbm offsets against the pool (``hbm_size``; None: this
    client asked for none), each with ``slot_offsets``' rules. hbm offsets went to the pool
    unchecked: a bool, an offset off a slot boundary, the same slot twice were accepted
    (found by review)."""
    offsets = reply.get("offsets")
    if not isinstance(offsets, list):
        raise ProtocolError(f"get_prepare reply has offsets {_short(offsets)}")
    if len(offsets) > n_keys:
        raise ProtocolError(f"daemon sent {len(offsets)} offsets for {n_keys} keys")
    devices = devices_of(reply, len(offsets))
    if "hbm" not in devices:
        slot_offsets(offsets, n_keys, nbytes, arena_size, exact=False)
        return offsets, devices
    if hbm_size is None:
        raise ProtocolError("daemon handed out hbm slots to a client that did not ask for "
                            "them")
    for device, size, where in (("cpu", arena_size, "arena"), ("hbm", hbm_size, "HBM pool")):
        slot_offsets([off for off, dev in zip(offsets, devices, strict=True) if dev == device],
                     n_keys, nbytes, size, exact=False, where=where)
    return offsets, devices


def prefix_results(reply: dict[str, Any], n_prompts: int) -> list[PrefixLocality]:
    """A prefix_locality reply's results: one map per prompt asked, of int counts
    (``results: 5`` or ``[]`` escaped as TypeError or IndexError; found by review)."""
    results = reply.get("results")
    if not isinstance(results, list) or len(results) != n_prompts:
        raise ProtocolError(f"daemon sent results {_short(results)} for {n_prompts} prompts")
    try:
        out = [PrefixLocality.from_dict(r) for r in results]
    except REPLY_ERRORS as exc:
        raise ProtocolError(f"daemon sent a prefix_locality result it cannot read "
                            f"({type(exc).__name__}: {_short(str(exc))})") from None
    for r, got in zip(results, out, strict=True):
        if not all(type(r[f]) is int and r[f] >= 0 for f in PREFIX_COUNTS) or \
                not got.hit_blocks <= got.prompt_blocks or got.tokens_per_block < 1:
            raise ProtocolError(f"daemon sent a prefix_locality result {_short(r)}")
    return out


PREFIX_COUNTS = ("tokens_per_block", "prompt_blocks", "hit_blocks", "local_blocks",
                 "redis_blocks")
