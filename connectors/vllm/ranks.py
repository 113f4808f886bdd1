"""The TP ranks of one engine agree on where a step's saves stop.

Each rank loads its own shard of a block; one rank's load can fail while the others'
succeed. The KV every rank then computes in the step depends on the failed shard (through
the all-reduce after attention), so all ranks must cut their saves where any rank's load
failed: a rank that saved its shard anyway left a wrong shard under a key that looked
complete once the failed rank saved its own after the recompute (red-team repro, TP 2).
"""

from __future__ import annotations

from collections.abc import Callable

NO_CUT = 1 << 62
"""A save not cut (the reduction takes the minimum over the ranks)."""

Agree = Callable[[list[int | None]], list[int | None]]
"""Cuts of a step's saves on this rank (block index or None) -> the cuts all ranks agree on
(the earliest per save). Every rank calls it, for the same saves, in the same step."""


def tp_agree(cuts: list[int | None]) -> list[int | None]:
    """The earliest cut per save over the engine's TP group (one all-reduce of a small
    integer tensor over vLLM's CPU process group)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    t = torch.tensor([NO_CUT if c is None else c for c in cuts], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return [None if v >= NO_CUT else int(v) for v in t.tolist()]
