"""The cost policy prices a block at its namespace's real token position (issue 12's
leftover): tokens per block come from the namespace's layout, passed by the store on insert,
not from a fixed 256."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.policy.base import Key, make_eviction_policy
from kvtier.policy.cost import CostPolicy
from kvtier.policy.costmodel import BlockCosts
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from kvtier.tiers.arena_mapping import ArenaMapping
from kvtier.tiers.base import TierName
from kvtier.tiers.nvme import NvmeTier
from tests.support.store import (
    ARENA_BLOCKS,
    CLIENT,
    DIGEST,
    FP,
    LAYOUT,
    TTL,
    FakeClock,
    chain,
    put,
)

BYTES_PER_TOKEN = 1024


def _insert(pol: CostPolicy, key: str, depth: int, block_tokens: int) -> None:
    pol.insert(key, nbytes=block_tokens * BYTES_PER_TOKEN, parent=None, depth=depth,
               block_tokens=block_tokens)


def test_a_32_token_namespace_is_ranked_by_its_real_token_positions() -> None:
    """Two roots: depth 40 of a 32-token-per-block namespace starts at token 1280, depth 8
    of a 256-token one at token 2048. Per byte, the later tokens cost more to recompute
    (attention grows with position), so the 32-token block is the one to evict. Priced as
    if every block held 256 tokens, depth 40 would sit at token 10240 and be kept."""
    costs = BlockCosts(block_tokens=256, block_bytes=256 * BYTES_PER_TOKEN)
    pol = CostPolicy(costs=costs)
    _insert(pol, "vllm-32", 40, 32)
    _insert(pol, "big-256", 8, 256)
    assert pol.victim() == "vllm-32"
    assert pol.value("vllm-32") < pol.value("big-256")

    # the same block, its layout unknown (0): the 256-token default puts it at token 10240
    blind = CostPolicy(costs=costs)
    blind.insert("vllm-32", nbytes=32 * BYTES_PER_TOKEN, parent=None, depth=40)
    _insert(blind, "big-256", 8, 256)
    assert blind.victim() == "big-256"


def test_within_a_namespace_deeper_blocks_are_worth_more_at_its_own_scale() -> None:
    """Equal-cost blocks of a 32-token namespace: the value per byte follows the token
    position depth x 32 (and equals a 256-token block's at the same token position)."""
    pol = CostPolicy(costs=BlockCosts(block_tokens=256, block_bytes=256 * BYTES_PER_TOKEN))
    _insert(pol, "d8x32", 8, 32)      # tokens 256..288
    _insert(pol, "d1x256", 1, 256)    # tokens 256..512
    _insert(pol, "d64x32", 64, 32)    # tokens 2048..2080
    assert pol.value("d8x32") < pol.value("d64x32")
    # the same start position: the 256-token block's mean position is later, worth more
    assert pol.value("d8x32") < pol.value("d1x256") < pol.value("d64x32")


class _Recording:
    """An LRU that records the ``block_tokens`` every insert carried."""

    def __init__(self) -> None:
        self.inner = make_eviction_policy("lru")
        self.name = "lru"
        self.block_tokens: list[int] = []

    def insert(self, key: Key, *, nbytes: int, parent: Key | None = None, depth: int = 0,
               now: float = 0.0, block_tokens: int = 0) -> None:
        self.block_tokens.append(block_tokens)
        self.inner.insert(key, nbytes=nbytes, parent=parent, depth=depth, now=now)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)


async def test_the_store_passes_the_namespace_tokens_per_block_on_insert(
        arena: Arena, client: ArenaMapping, clock: FakeClock, tmp_path: Path) -> None:
    made: dict[TierName, _Recording] = {}

    def factory(name: str, tier: TierName) -> Any:
        made[tier] = _Recording()
        return made[tier]

    store = TieredStore(arena, eviction="lru", lease_ttl_s=TTL, prefetch_wait="wait",
                        clock=clock, policy_factory=factory)
    store.register_namespace(LAYOUT, "test/model", 0, 1, None)
    assert LAYOUT.tokens_per_block != 256  # the test's layout is not the old default
    await put(store, client, chain(3), owner=CLIENT)
    assert made[TierName.CPU].block_tokens == [LAYOUT.tokens_per_block] * 3
    assert store.block_tokens(store.index[chain(1)[0]]) == LAYOUT.tokens_per_block
    assert (await store.lookup(DIGEST, FP, chain(3))).hits == 3
    await store.drain(clock() + 5)


async def test_blocks_demoted_to_nvme_keep_their_namespace_tokens_per_block(
        arena: Arena, nvme: NvmeTier, client: ArenaMapping, clock: FakeClock) -> None:
    made: dict[TierName, _Recording] = {}

    def factory(name: str, tier: TierName) -> Any:
        made[tier] = _Recording()
        return made[tier]

    store = TieredStore(arena, nvme=nvme, eviction="lru", lease_ttl_s=TTL,
                        prefetch_wait="wait", clock=clock, policy_factory=factory)
    store.register_namespace(LAYOUT, "test/model", 0, 1, None)
    for k in chain(ARENA_BLOCKS + 2):   # the arena holds ARENA_BLOCKS: two go down to nvme
        await put(store, client, [k], owner=CLIENT)
    assert made[TierName.NVME].block_tokens == [LAYOUT.tokens_per_block] * 2
    await store.drain(clock() + 5)


def test_the_saved_seconds_memo_stays_bounded(monkeypatch: Any) -> None:
    """Clients choose depths and layouts: the memo of per-depth savings never grows past
    its bound however many distinct ones arrive."""
    import kvtier.policy.cost as cost

    monkeypatch.setattr(cost, "SAVED_MEMO_MAX", 64)
    pol = CostPolicy(costs=BlockCosts(block_tokens=16, block_bytes=16 * BYTES_PER_TOKEN))
    values = [pol._saved_per_byte(depth, 4096, 16) for depth in range(1000)]
    assert len(pol._saved) <= 64
    assert pol._saved_per_byte(999, 4096, 16) == values[999]   # recomputed alike
