"""The event loop's lag (kvtier.daemon.loop_lag): a loop held by a callback is measured as
late as it was held; an idle one reads near zero; stop ends the measurements."""

from __future__ import annotations

import asyncio
import time

from kvtier.daemon.loop_lag import LoopLag


async def test_a_held_loop_is_measured_as_lag() -> None:
    seen: list[float] = []
    lag = LoopLag(seen.append, period_s=0.005)
    lag.start()
    await asyncio.sleep(0.03)   # idle ticks
    idle = list(seen)
    time.sleep(0.06)            # the loop held: the tick due meanwhile runs that late
    await asyncio.sleep(0.03)
    lag.stop()
    assert len(idle) >= 2 and lag.ticks == len(seen) > len(idle)
    assert max(seen) >= 0.04 and lag.worst_s == max(seen)
    assert lag.stats() == {"lag_worst_s": round(max(seen), 6), "lag_ticks": len(seen)}
    ticks = lag.ticks
    await asyncio.sleep(0.02)
    assert lag.ticks == ticks   # stopped: no more measurements


def test_kvtier_stats_shows_the_worst_lag_when_the_daemon_reports_it() -> None:
    from kvtier.cli import render_stats

    head = render_stats({"daemon": {"loop": {"lag_worst_s": 0.0123, "lag_ticks": 9}}})
    assert "event loop worst lag 12 ms" in head.splitlines()[0]
    assert "event loop" not in render_stats({"daemon": {}})   # an older daemon
