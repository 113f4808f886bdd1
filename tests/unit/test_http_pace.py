"""The HTTP server's bounds on its synchronous renders (kvtier.daemon.http_pace), in-process
with a fake clock or fake renders (found by review: floods of /metrics and /v1/stats
starved the engines' control socket)."""

from __future__ import annotations

import asyncio
import itertools
import time
from functools import partial

import pytest

from kvtier.daemon.http_pace import Pacer, RenderCache
from kvtier.errors import Overloaded


def test_metrics_are_rendered_a_few_times_a_window_then_served_from_the_cache() -> None:
    now = [100.0]
    cache = RenderCache(max_age_s=1.0, fresh=4, clock=lambda: now[0])
    n = [0]

    def render() -> bytes:
        n[0] += 1
        return b"body %d" % n[0]

    bodies = [cache.get(render) for _ in range(4)]       # an operator's scrapes: fresh
    assert bodies == [b"body 1", b"body 2", b"body 3", b"body 4"]
    now[0] += 0.5
    assert [cache.get(render) for _ in range(100)] == [b"body 4"] * 100   # a flood
    assert (cache.renders, cache.served_cached) == (4, 100)
    now[0] += 0.6                                          # the first renders aged out
    assert cache.get(render) == b"body 5"
    now[0] += 5.0                                          # a scrape every 10-60 s
    assert cache.get(render) == b"body 6"


def test_renders_take_turns_with_pauses_and_a_queue_beyond_which_503() -> None:
    """One render at a time; after one of d seconds the next starts d * (1/share - 1) later;
    at most max_waiting wait (the rest: Overloaded)."""
    starts: list[float] = []

    def render() -> float:
        starts.append(time.monotonic())
        time.sleep(0.01)
        return starts[-1]

    async def main() -> list[object]:
        pacer = Pacer(share=0.25, max_waiting=4)
        return await asyncio.gather(*(pacer.run(render) for _ in range(10)),
                                    return_exceptions=True)

    results = asyncio.run(main())
    served = [r for r in results if isinstance(r, float)]
    refused = [r for r in results if isinstance(r, Overloaded)]
    # the first renders at once (nothing waits meanwhile: it never yields), 4 then queue
    assert (len(served), len(refused)) == (5, 5)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(g >= 0.01 + 0.03 * 0.9 for g in gaps), gaps   # render + 3 x render


def test_a_slow_render_pauses_at_most_max_gap() -> None:
    async def main() -> float:
        pacer = Pacer(share=0.01, max_gap_s=0.05)
        await pacer.run(lambda: time.sleep(0.02))
        t0 = time.monotonic()
        await pacer.run(lambda: None)
        return time.monotonic() - t0

    assert 0.04 <= asyncio.run(main()) < 1.5   # 99 x 20 ms without the cap


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_a_lone_caller_is_not_refused(share: float) -> None:
    async def main() -> list[int]:
        pacer = Pacer(share=share, max_waiting=1)
        return [await pacer.run(partial(int, i)) for i in range(5)]   # renders i

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
