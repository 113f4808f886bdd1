"""Public ids and text that untrusted requests name: namespace ids are keyed per process
(no offline salt test), and a lone surrogate is a typed error wherever a namespace or
layout is built, never a UnicodeEncodeError."""

from __future__ import annotations

import pytest
import xxhash

from kvtier.errors import LayoutMismatch
from kvtier.explain import MissLog, namespace_id, salt_id
from kvtier.keys import Namespace
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)


def test_namespace_id_is_keyed_and_stable() -> None:
    digest = Namespace("m", LAYOUT, cache_salt="tenant").digest
    nid = namespace_id(digest)
    assert nid == namespace_id(digest) and len(nid) == 16
    assert nid != xxhash.xxh3_64_hexdigest(b"kvtier-namespace-id:" + digest)
    assert nid != namespace_id(Namespace("m", LAYOUT, cache_salt="other").digest)
    log = MissLog(clock=lambda: 1.0)
    log.lookup(digest, [b"k" * 16], 1, 1, 1, set(), False)
    assert log.recent(1)[0]["namespace"] == nid


def test_lone_surrogates_are_typed_errors() -> None:
    with pytest.raises(LayoutMismatch, match="surrogate"):
        KVLayout(1, 1, 8, "float16", 16, kv_format="\ud800")
    with pytest.raises(LayoutMismatch, match="surrogate"):
        Namespace("\ud800", LAYOUT)
    with pytest.raises(LayoutMismatch, match="surrogate"):
        Namespace("m", LAYOUT, cache_salt="\udfff")
    assert salt_id("\udfff") is not None   # an id of anything, never a crash
