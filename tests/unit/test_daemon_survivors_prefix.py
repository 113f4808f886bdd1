"""Survivors of the request-handling mutation round: the prefix-locality probe
(``kvtier.daemon.prefix``, ``kvtier.daemon.prefix_input``) in-process, no process and no
Redis server (a scripted tier answers ``exists_prefix`` where Redis is needed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.daemon.limits import Limits
from kvtier.daemon.prefix import PrefixProbe
from kvtier.daemon.prefix_input import MAX_PROMPTS, ModelIndex, json_prompt, split_prompts
from kvtier.errors import LimitExceeded, ProtocolError
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.prefix import RedisProbe
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)
LIMITS = Limits(max_context_tokens=1024)   # 64 keys a prompt
NS = Namespace("m", LAYOUT)


@pytest.fixture
def arena() -> Iterator[Arena]:
    with temp_arena(8 * LAYOUT.block_bytes, LAYOUT.block_bytes) as a:
        yield a


class ScriptedRedis:
    """``RedisTier.exists_prefix`` over a set of keys: the leading run present."""

    up = True

    def __init__(self, held: set[bytes]) -> None:
        self.held = held

    async def exists_prefix(self, keys: list[bytes], namespace: bytes) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n


def test_redis_blocks_count_from_block_zero_and_stop_at_a_hole_in_the_local_prefix() -> None:
    """``redis_blocks`` is the leading run Redis holds from block 0 (what any node attached
    to it can load): when Redis lacks a block inside this node's local prefix, it is the
    run before that hole, not that run plus what Redis holds after the local prefix. The
    blocks a lookup here adds after the local prefix are counted apart. Mutant that
    survived: the head's run and the tail's were added even when the head stopped short."""
    keys = block_keys(NS, range(4 * LAYOUT.tokens_per_block))
    store = SimpleNamespace(redis=ScriptedRedis({keys[0], keys[3]}),
                            redis_lookup_budget_s=5.0)
    probe = PrefixProbe(store, LIMITS)   # type: ignore[arg-type]
    # blocks 0..2 are local here, Redis holds 0 and 3: one block from zero, one after
    got = asyncio.run(probe._redis(keys, 3, NS.digest, True))
    assert got == (RedisProbe.OK, 1, 1)
    store.redis.held = set(keys)   # Redis holds the whole prompt: head and tail add up
    assert asyncio.run(probe._redis(keys, 3, NS.digest, True)) == (RedisProbe.OK, 4, 1)


def _json_probe(n_keys: int) -> bytes:
    keys = block_keys(NS, range(n_keys * LAYOUT.tokens_per_block))
    return json.dumps({"model_id": "m", "layout": LAYOUT.to_dict(), "redis": False,
                       "block_keys": [k.hex() for k in keys]}).encode()


def test_a_json_prompt_of_block_keys_is_bounded_by_the_context_limit(arena: Arena) -> None:
    """A JSON probe naming its prompt by ``block_keys`` carries at most
    ``max_keys(tokens_per_block)`` keys (here 64): one more is a LimitExceeded (a 413),
    exactly the limit is answered. Only ``_check_prompt`` bounds this form (a binary body
    is bounded when it is split). Mutant that survived: the bound was one key too lax."""
    probe = PrefixProbe(TieredStore(arena), LIMITS)
    limit = LIMITS.max_keys(LAYOUT.tokens_per_block)
    reply: dict[str, Any] = asyncio.run(probe.from_http(_json_probe(limit), "application/json",
                                                        {}))
    assert reply["prompt_blocks"] == limit and reply["redis"] == "skipped"
    with pytest.raises(LimitExceeded, match=f"{limit + 1} keys in one prompt"):
        asyncio.run(probe.from_http(_json_probe(limit + 1), "application/json", {}))


@pytest.mark.parametrize("as_keys", [False, True])
def test_negative_prompt_lengths_are_refused(as_keys: bool) -> None:
    """``lengths`` (a batch's cut of one blob, from the control op or ``?lengths=``) are
    non-negative ints: ``[3, -1]`` adds up to a blob of two items but names a prompt of
    three (cut short) and one of -1, so it is a ProtocolError, not two answers for
    prompts nobody sent. Mutant that survived: the sign check dropped."""
    unit = 16 if as_keys else 4
    blob = bytes(2 * unit)
    with pytest.raises(ProtocolError, match="non-negative"):
        split_prompts(None if as_keys else blob, blob if as_keys else None, [3, -1], 64)
    assert len(split_prompts(None if as_keys else blob, blob if as_keys else None,
                             [2, 0], 64)) == 2


@pytest.mark.parametrize("doc", [
    {"token_ids": [1, 2], "block_keys": ["00" * 16]},   # two forms at once
    {"token_ids": [[1, 2], [3, 4]]},                      # not flat
])
def test_a_json_prompt_is_one_flat_form_of_whole_keys(doc: dict[str, Any]) -> None:
    """A JSON prompt gives exactly one of ``token_ids``, ``tokens_b64`` or ``block_keys``;
    its token ids are a flat list: anything else is a ProtocolError (a 400), not a probe
    of something else than the router meant. Mutants that survived: two forms taken, the
    first used (pi-given), and a nested list taken as tokens (pi-ndim)."""
    with pytest.raises(ProtocolError):
        json_prompt(doc)



def test_the_model_index_sees_a_namespace_registered_in_an_evicted_ones_place() -> None:
    """``ModelIndex`` rebuilds its by-model table when the registered set changed, its
    size or the count of evictions: a namespace evicted and another registered (the same
    size) is seen, so /v1/prefix by model id finds the new model. Mutant that survived
    (pi-version): only the size was compared, so the old model was still named and the
    new one was not found."""
    old, new = Namespace("old", LAYOUT), Namespace("new", LAYOUT)
    store = SimpleNamespace(namespaces={old.digest: SimpleNamespace(namespace=old)},
                            namespaces_evicted=0)
    index = ModelIndex(store)  # type: ignore[arg-type]
    assert index.named("old", 0, 1) == [old]
    store.namespaces = {new.digest: SimpleNamespace(namespace=new)}
    store.namespaces_evicted = 1
    assert index.named("new", 0, 1) == [new] and index.named("old", 0, 1) == []


def test_a_binary_token_batchs_body_limit_is_counted_in_tokens(arena: Arena) -> None:
    """For a binary batch cut by ``?lengths=``, the most body bytes to read is what the
    lengths make in the body's own unit: 4 bytes a token (16 a key with
    ``?input=keys``); a larger declared body is refused before it is read. Mutant that
    survived (px-httplim-unit): tokens were counted at 16 bytes, so a body four times
    what its lengths allow was read before being refused."""
    store = TieredStore(arena)
    store.register_namespace(LAYOUT, NS.model_id, 0, 1, None)
    probe = PrefixProbe(store, LIMITS)
    query = {"namespace": NS.digest.hex(), "lengths": "3,4"}
    assert probe.http_limit("application/octet-stream", query, None) == 7 * 4
    keys = {**query, "input": "keys"}
    assert probe.http_limit("application/octet-stream", keys, None) == 7 * 16


def test_a_binary_probes_query_is_checked_before_its_body(arena: Arena) -> None:
    """What ``?lengths=`` and ``?redis=`` say is read from the query before the body:
    ``MAX_PROMPTS`` commas name one prompt too many (LimitExceeded before a byte of the
    body is read, whatever the lengths add up to), and ``redis=false``/``no``/``0`` each
    skip Redis. Mutants that survived: one prompt too many let through
    (px-lengths-commas) and only ``0`` read as no (px-redis-query)."""
    store = TieredStore(arena)
    store.register_namespace(LAYOUT, NS.model_id, 0, 1, None)
    probe = PrefixProbe(store, LIMITS)
    query = {"namespace": NS.digest.hex()}
    with pytest.raises(LimitExceeded, match="prompts in one request"):
        probe.http_limit("application/octet-stream",
                         {**query, "lengths": ",".join(["0"] * (MAX_PROMPTS + 1))}, None)
    assert probe.http_limit("application/octet-stream",
                            {**query, "lengths": ",".join(["0"] * MAX_PROMPTS)}, None) == 0
    for no in ("0", "false", "No"):
        assert probe._octet_query({**query, "redis": no})[3] is False
    assert probe._octet_query(query)[3] is True
