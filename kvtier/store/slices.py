"""Long per-block loops give the event loop back now and then.

A request may name up to ``max_context_tokens / tokens_per_block`` keys (8192 at the
defaults and 16 tokens per block), and the store spends 1-8 us of Python per block on a
lookup, get, commit or delete: one such request held the event loop, and with it every
other client, for 20-100 ms (benchmarks/bench_neighbors.py: another client's ping waited
up to 100 ms, p99 85 ms; 13-15 ms, p99 7-8.5 ms, with turns). A loop over blocks takes
turns instead: every ``CHECK_EVERY`` blocks it looks at the time, and once ``SLICE_S`` has
passed since its turn began it lets the event loop serve whatever is ready
(``asyncio.sleep(0)``) before going on. A request shorter than a slice never pauses, so
the common case costs one clock read per 32 blocks.

A loop that pauses must expect the index to have changed meanwhile, as it already must
across any other await: each user re-reads what it holds after a pause.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["CHECK_EVERY", "SLICE_S", "Turn", "slices"]

SLICE_S = 0.001     # the event loop held at most about this long by one request at a time
CHECK_EVERY = 32    # blocks between two looks at the clock

T = TypeVar("T")


@dataclass(slots=True)
class Turn:
    """One request's turn on the event loop; ``due(i)`` at block ``i`` says when to pause."""

    ends: float = field(init=False)

    def __post_init__(self) -> None:
        self.ends = time.perf_counter() + SLICE_S

    def due(self, i: int) -> bool:
        """Whether the loop at block ``i`` should pause now (checked every CHECK_EVERY)."""
        return i % CHECK_EVERY == CHECK_EVERY - 1 and self.over()

    def over(self) -> bool:
        """Whether the turn is over (a loop over batches asks between two)."""
        return time.perf_counter() >= self.ends

    async def pause(self) -> None:
        """Let the event loop run what is ready, then start a new turn."""
        await asyncio.sleep(0)
        self.ends = time.perf_counter() + SLICE_S


def slices(items: Sequence[T], n: int = CHECK_EVERY) -> Iterator[Sequence[T]]:
    """``items`` in consecutive pieces of ``n`` (batch work between two ``due`` checks)."""
    for lo in range(0, len(items), n):
        yield items[lo: lo + n]
