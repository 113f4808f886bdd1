"""The prefix-locality probe in-process (real arena, no tiers below): any request a client
or router can send is answered or refused with a typed error, never a crash, and the
bounds of kvtier.daemon.limits hold."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.daemon.limits import Limits
from kvtier.daemon.prefix import MAX_PROMPTS, PrefixProbe
from kvtier.errors import KVTierError, LimitExceeded
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)
LIMITS = Limits(max_context_tokens=1024)


@pytest.fixture(scope="module")
def arena() -> Iterator[Arena]:
    with temp_arena(64 * LAYOUT.block_bytes, LAYOUT.block_bytes) as a:
        yield a


@pytest.fixture(scope="module")
def probe(arena: Arena) -> PrefixProbe:
    store = TieredStore(arena)
    store.register_namespace(LAYOUT, "m", 0, 1, None)
    return PrefixProbe(store, LIMITS)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=80),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=12)
fields = st.sampled_from(["ns", "namespace", "model_id", "layout", "tp_rank", "tp_size",
                          "cache_salt", "tokens", "keys", "lengths", "redis", "prompts",
                          "token_ids", "tokens_b64", "block_keys"])

# half the requests name a real namespace, so the fuzz reaches past its resolution
bases = st.sampled_from([{}, {"model_id": "m"}, {"model_id": "m", "layout": LAYOUT.to_dict()}])
requests = st.builds(lambda base, extra: {**base, **extra}, bases,
                     st.dictionaries(fields, values | st.binary(max_size=200), max_size=6))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=requests)
def test_any_control_request_is_answered_or_typed(probe: PrefixProbe,
                                                  msg: dict[str, Any]) -> None:
    try:
        reply = run(probe.from_control(msg))
    except KVTierError:
        return
    assert all(r["hit_blocks"] == 0 for r in reply["results"])   # nothing is stored


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=requests,
       kind=st.sampled_from(["application/json", "application/octet-stream", "text/x"]))
def test_any_http_body_is_answered_or_typed(probe: PrefixProbe, doc: dict[str, Any],
                                            kind: str) -> None:
    body = json.dumps(doc, default=repr).encode() if kind != "application/octet-stream" \
        else msgpack.packb(doc, default=repr)
    query = {k: str(v) for k, v in doc.items()}
    try:
        run(probe.from_http(body, kind, query))
    except KVTierError:
        return


def test_bounds_are_the_daemons(probe: PrefixProbe) -> None:
    ns = Namespace("m", LAYOUT)
    spec = {"model_id": "m"}
    at_limit = np.zeros(LIMITS.max_context_tokens, dtype="<u4").tobytes()
    reply = run(probe.from_control({**spec, "tokens": at_limit}))
    assert reply["results"][0]["prompt_blocks"] == LIMITS.max_context_tokens // 16
    with pytest.raises(LimitExceeded):
        run(probe.from_control({**spec, "tokens": at_limit + b"\0\0\0\0"}))
    keys = block_keys(ns, np.arange(LIMITS.max_context_tokens + 16))
    with pytest.raises(LimitExceeded):
        run(probe.from_control({**spec, "keys": b"".join(keys)}))
    with pytest.raises(LimitExceeded):   # four contexts in one batch at most
        run(probe.from_control({**spec, "tokens": at_limit * 5, "lengths": [1024] * 5}))
    with pytest.raises(LimitExceeded):
        run(probe.from_control({**spec, "tokens": b"", "lengths": [0] * (MAX_PROMPTS + 1)}))
    with pytest.raises(LimitExceeded):
        run(probe.from_http(b" " * (4 * 2**20 + 1), "application/json", {}))
