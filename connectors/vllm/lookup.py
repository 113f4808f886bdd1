"""The scheduler's lookup of a request's leading blocks, over every TP shard.

A block is usable only if every shard of it is in kvtier, so the leading count is the
minimum over one rank per shard. The chain up to the first block past vLLM's own hit
decides most misses (a new prompt, however long, is ruled out by its first key), so the
rest of the chain is hashed only when the presence filter cannot answer from that head, and
no round trip is made when the filter says nothing goes past vLLM's hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import block_keys

from .link import DaemonLink
from .recompute import RecomputeModel


@dataclass(slots=True)
class LeadingBlocks:
    """``hits``: leading blocks every shard holds; ``usable``: of those, how many are faster
    to load than to recompute (``hits`` when that is not asked); ``filtered``: the presence
    filter answered without a round trip."""

    hits: int
    usable: int
    filtered: bool = False


def leading_blocks(link: DaemonLink, recompute: RecomputeModel | None, salt: str | None,
                   tokens: Sequence[int], n_blocks: int, start: int, tokens_per_block: int,
                   *, presence_filter: bool) -> LeadingBlocks:
    """Leading blocks of ``tokens`` (``n_blocks`` whole ones) in kvtier, vLLM holding the
    first ``start``; ``recompute``: weigh loading against recomputing (None: load all)."""
    hits = usable = n_blocks
    tpb = tokens_per_block
    for rank in range(0, link.tp_size, link.replicas):   # one rank per shard
        ns = link.namespace(salt, rank)
        head = min(hits, start + 1)
        keys = block_keys(ns, tokens[: head * tpb])
        bound = link.leading_bound(keys) if presence_filter else None
        if bound is not None and bound <= start:
            # nothing kvtier holds goes past what vLLM already has: no round trip
            return LeadingBlocks(min(hits, bound), usable, filtered=True)
        if hits > head:
            keys += block_keys(ns, tokens[head * tpb: hits * tpb], parent=keys[-1])
            if bound is not None:
                bound = link.leading_bound(keys)
        res = link.lookup_result(ns, keys if bound is None else keys[:bound])
        hits = min(hits, res.hits if res is not None else 0)
        if res is not None and recompute is not None:
            usable = min(usable, recompute.worth_loading(res.tiers, res.bandwidth, start,
                                                         res.hits))
        if hits == 0:
            break
    return LeadingBlocks(hits, usable)
