"""Prefix locality: how much of a prompt one node can serve from cache, and from where.

A KV-aware router asks each node (``POST /v1/prefix`` or the ``prefix_locality`` control
op) how many leading tokens of a prompt it holds, to send the request where the most
prefill is already done. The answer is a read-only probe: it never promotes, prefetches,
touches eviction order or counts as a lookup. Shared by the daemon, which builds it, and
the client, which reads it back (docs/prefix-locality.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class RedisProbe(str, Enum):
    """What the answer's Redis figures mean."""

    OK = "ok"            # probed: redis_blocks is the leading run present in Redis
    OFF = "off"          # this daemon has no Redis tier
    DOWN = "down"        # the tier is down: nothing is served from it now
    SKIPPED = "skipped"  # the caller asked not to probe Redis
    TIMEOUT = "timeout"  # the probe ran past redis.lookup_budget_s: counted as no blocks


@dataclass(frozen=True, slots=True)
class PrefixLocality:
    """Leading blocks of one prompt cached for one namespace.

    ``hit_blocks`` is what a lookup on this node would find now: the local prefix (cpu or
    nvme, ``local_blocks``, split in ``tier_blocks``) followed by the blocks Redis holds
    after it. ``redis_blocks`` counts from block 0, so any node attached to the same Redis
    can load that many, whatever it holds itself. Only full blocks count: tokens are
    ``blocks * tokens_per_block``.
    """

    tokens_per_block: int
    prompt_blocks: int
    hit_blocks: int
    local_blocks: int
    tier_blocks: dict[str, int]
    redis: RedisProbe
    redis_blocks: int

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.tokens_per_block

    @property
    def local_tokens(self) -> int:
        return self.local_blocks * self.tokens_per_block

    @property
    def redis_tokens(self) -> int:
        return self.redis_blocks * self.tokens_per_block

    def to_dict(self) -> dict[str, Any]:
        """The wire form (JSON and msgpack): blocks and tokens both, for readers of either."""
        tpb = self.tokens_per_block
        return {
            "tokens_per_block": tpb, "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks, "hit_tokens": self.hit_blocks * tpb,
            "local_blocks": self.local_blocks, "local_tokens": self.local_blocks * tpb,
            "tier_blocks": dict(self.tier_blocks),
            "redis": self.redis.value, "redis_blocks": self.redis_blocks,
            "redis_tokens": self.redis_blocks * tpb,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefixLocality:
        return cls(int(data["tokens_per_block"]), int(data["prompt_blocks"]),
                   int(data["hit_blocks"]), int(data["local_blocks"]),
                   {str(k): int(v) for k, v in dict(data["tier_blocks"]).items()},
                   RedisProbe(data["redis"]), int(data["redis_blocks"]))
