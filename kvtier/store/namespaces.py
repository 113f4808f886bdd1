"""Registered namespaces: who may see which blocks, and with which layout.

A namespace (model, tp rank/size, cache salt, layout) is registered by each client
connection; its digest travels with every request. The registry checks the digest and the
layout fingerprint, decides whether a stored block belongs to the caller (``foreign``), and
hands the layout to whoever needs a block's geometry (slot size, tokens per block).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.errors import LayoutMismatch, ProtocolError, UnknownNamespace
from kvtier.index import BlockMeta
from kvtier.keys import KEY_BYTES, Namespace
from kvtier.layout import KVLayout
from kvtier.store.stats import RequestCounters
from kvtier.tiers.aligned import round_up
from kvtier.weights import base_model_id

__all__ = ["NamespaceEntry", "NamespaceRegistry", "split_keys"]


@dataclass(slots=True)
class NamespaceEntry:
    namespace: Namespace
    layout: KVLayout
    slot_bytes: int


def split_keys(blob: bytes) -> list[bytes]:
    """The 16-byte keys packed in ``blob`` (a wire field); ProtocolError when malformed."""
    if not isinstance(blob, bytes) or len(blob) % KEY_BYTES:
        raise ProtocolError(f"keys must be a byte string of 16-byte keys, "
                            f"got {type(blob).__name__} of length {len(blob)}")
    return [blob[i: i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


class NamespaceRegistry:
    """Least recently used first; beyond ``max_namespaces`` the head is forgotten (its blocks
    stay; a client that uses it again gets UnknownNamespace and re-registers)."""

    def __init__(self, requests: RequestCounters, max_namespaces: int = 4096) -> None:
        self.entries: OrderedDict[bytes, NamespaceEntry] = OrderedDict()
        # (model id or its base, cache salt, tp rank, tp size) -> digests: a router's probe
        # names a model, and finds its namespaces without a scan of every registered one
        self._named: dict[tuple[str, str | None, int, int], dict[bytes, None]] = {}
        self.max_namespaces = max(1, max_namespaces)
        self.evicted = 0
        self._requests = requests

    def register(self, layout: KVLayout, model_id: str, tp_rank: int, tp_size: int,
                 cache_salt: str | None) -> Namespace:
        ns = Namespace(model_id, layout, tp_rank, tp_size, cache_salt)
        self.entries[ns.digest] = NamespaceEntry(ns, layout, round_up(layout.block_bytes))
        self.entries.move_to_end(ns.digest)
        for name in _names(ns):
            self._named.setdefault(name, {})[ns.digest] = None
        while len(self.entries) > self.max_namespaces:
            _digest, gone = self.entries.popitem(last=False)
            for name in _names(gone.namespace):
                digests = self._named.get(name)
                if digests is not None:
                    digests.pop(gone.namespace.digest, None)
                    if not digests:
                        del self._named[name]
            self.evicted += 1
        return ns

    def named(self, model_id: str, cache_salt: str | None, tp_rank: int,
              tp_size: int) -> list[Namespace]:
        """The registered namespaces of ``model_id`` (its full id, or the base of one with a
        weights fingerprint, ``kvtier.weights``) with this salt and tensor-parallel place."""
        digests = self._named.get((model_id, cache_salt, tp_rank, tp_size), ())
        return [self.entries[d].namespace for d in digests]

    def touch(self, digest: bytes) -> KVLayout | None:
        """The layout a registered namespace uses (marking it recently used), or None."""
        entry = self.entries.get(digest)
        if entry is None:
            return None
        self.entries.move_to_end(digest)
        return entry.layout

    def resolve(self, digest: bytes, layout_fp: int) -> NamespaceEntry:
        """The caller's namespace; UnknownNamespace or LayoutMismatch when it cannot be."""
        entry = self.entries.get(digest)
        if entry is None:
            raise UnknownNamespace("namespace not registered with this daemon: call "
                                   "register_layout first (the daemon may have restarted)")
        if entry.layout.fingerprint != layout_fp:
            raise LayoutMismatch("the layout fingerprint does not match the namespace's "
                                 "registered layout")
        return entry

    def layout(self, digest: bytes) -> KVLayout | None:
        """The layout of ``digest`` without touching its recency (for codecs, cost model)."""
        entry = self.entries.get(digest)
        return None if entry is None else entry.layout

    def foreign(self, meta: BlockMeta, ns: NamespaceEntry) -> bool:
        """True (and counted) when ``meta`` is not the caller's to see: stored under another
        namespace (knowing a key is not a permission), or under another layout or block size
        (its slot would be read with the wrong length). To the caller it is a miss."""
        if meta.namespace != ns.namespace.digest:
            self._requests.namespace_mismatch += 1
            return True
        if meta.layout_fp != ns.layout.fingerprint or meta.nbytes != ns.layout.block_bytes:
            self._requests.layout_mismatch += 1
            return True
        return False

    def __len__(self) -> int:
        return len(self.entries)


def _names(ns: Namespace) -> set[tuple[str, str | None, int, int]]:
    """The names a router may give ``ns`` by: its model id, and that id's base."""
    return {(m, ns.cache_salt, ns.tp_rank, ns.tp_size)
            for m in (ns.model_id, base_model_id(ns.model_id))}
