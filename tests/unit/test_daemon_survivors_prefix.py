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
from kvtier.daemon.prefix_input import split_prompts
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
