"""The probe's index walk (``PrefixProbe.probe``, its ``BlockMeta.present`` checks inlined
and taken ``CHECK_EVERY`` blocks at a time) counts exactly what the plain per-block walk
of ``TieredStore.lookup`` counts, for any mix of block states, namespaces and layouts and a
first miss anywhere, slice boundaries included; and ``block_keys`` (views, two updates per
block) is the chain spelled out with bytes."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.daemon.limits import Limits
from kvtier.daemon.prefix import PrefixProbe
from kvtier.index import BlockMeta, SlotState
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.store.slices import CHECK_EVERY
from kvtier.tiers.arena import Arena
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)
OTHER = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                 tokens_per_block=32)
N = 3 * CHECK_EVERY + 5   # blocks per chain: misses in every slice and at its edges

# what one block of the chain is in the index: found by a lookup, or a miss
PRESENT = ["ready", "loading", "nvme", "ready+nvme"]
MISSING = ["absent", "writing", "nvme-unready", "foreign-ns", "foreign-layout",
           "foreign-nbytes"]


@pytest.fixture(scope="module")
def arena() -> Iterator[Arena]:
    with temp_arena(64 * LAYOUT.block_bytes, LAYOUT.block_bytes) as a:
        yield a


def _meta(key: bytes, kind: str, ns: Namespace) -> BlockMeta | None:
    if kind == "absent":
        return None
    digest = b"\x01" * 16 if kind == "foreign-ns" else ns.digest
    fp = OTHER.fingerprint if kind == "foreign-layout" else LAYOUT.fingerprint
    nbytes = LAYOUT.block_bytes + (1 if kind == "foreign-nbytes" else 0)
    state = {"ready": SlotState.READY, "ready+nvme": SlotState.READY,
             "loading": SlotState.LOADING, "writing": SlotState.WRITING}.get(
        kind, SlotState.READY if kind.startswith("foreign") else SlotState.NONE)
    slot: Any = object() if kind.startswith("nvme") or kind == "ready+nvme" else None
    return BlockMeta(key, digest, fp, nbytes, None, 0, cpu_state=state, nvme=slot,
                     nvme_ready=kind != "nvme-unready")


def _reference(store: TieredStore, ns: Namespace, keys: list[bytes]) -> tuple[int, int]:
    """(local, cpu): the walk as it was written before, one ``present`` per block."""
    local = cpu = 0
    for k in keys:
        meta = store.index.get(k)
        if (meta is None or not meta.present or meta.namespace != ns.digest
                or meta.layout_fp != LAYOUT.fingerprint or meta.nbytes != LAYOUT.block_bytes):
            break
        local += 1
        if meta.cpu_state in (SlotState.READY, SlotState.LOADING):
            cpu += 1
    return local, cpu


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(PRESENT), min_size=N, max_size=N),
       miss=st.integers(0, N), why=st.sampled_from(MISSING))
def test_the_walk_counts_what_a_lookup_would(arena: Arena, kinds: list[str], miss: int,
                                            why: str) -> None:
    store = TieredStore(arena)
    ns = store.register_namespace(LAYOUT, "m", 0, 1, None)
    keys = [i.to_bytes(16, "little") for i in range(N)]
    if miss < N:
        kinds = [*kinds[:miss], why, *kinds[miss + 1:]]
    for key, kind in zip(keys, kinds, strict=True):
        meta = _meta(key, kind, ns)
        if meta is not None:
            store.index[key] = meta
    got = asyncio.run(PrefixProbe(store, Limits()).probe(ns, keys, redis=False))
    local, cpu = _reference(store, ns, keys)
    assert (got.local_blocks, got.tier_blocks, got.hit_blocks, got.prompt_blocks) == \
        (local, {"cpu": cpu, "nvme": local - cpu}, local, N)
    assert local == miss


@pytest.mark.parametrize("tpb", [1, 16, 256])
@pytest.mark.parametrize("container", ["u4-view-of-bytes", "int64", "strided"])
def test_block_keys_are_the_bytes_chain(tpb: int, container: str) -> None:
    ns = Namespace("m", LAYOUT)
    ids = np.random.default_rng(tpb).integers(0, 2**32, 5 * tpb + tpb // 2, dtype=np.int64)
    tokens: Any = {"u4-view-of-bytes": np.frombuffer(ids.astype("<u4").tobytes(), "<u4"),
                   "int64": ids,
                   "strided": np.repeat(ids.astype("<u4"), 2)[::2]}[container]
    data, prev, want = ids.astype("<u4").tobytes(), b"\x07" * 16, []
    for off in range(0, 5 * tpb * 4, tpb * 4):   # (a trailing partial block is not keyed)
        prev = hashlib.blake2b(ns.digest + prev + data[off:off + tpb * 4], digest_size=16,
                               person=b"kvtier-key/2").digest()
        want.append(prev)
    assert block_keys(ns, tokens, tpb, parent=b"\x07" * 16) == want
