"""``--plot FILE.png``: token hit rate against capacity, one line per policy.

matplotlib is an optional extra (``pip install kvtier[plot]``); it is imported only here,
only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import KVTierError
from kvtier.replay.simulator import ReplayResult


class PlotUnavailable(KVTierError):
    """matplotlib is not installed."""

    code = "plot_unavailable"


def plot_hit_rates(results: Sequence[ReplayResult], path: str | Path) -> Path:
    """Draw token hit rate vs. capacity fraction for each policy and save it to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'kvtier[plot]' (or drop --plot)"
        ) from None
    series: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if r.capacity_fraction is not None:
            series.setdefault(r.policy, []).append((r.capacity_fraction, r.token_hit_rate))
    if not series:  # --tier runs have no capacity fraction (the CLI refuses them first)
        raise KVTierError("--plot draws runs sized by --capacity-fraction: there are none")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, points in series.items():
        points.sort()
        ax.plot([x * 100 for x, _ in points], [y for _, y in points], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (% of the trace's unique blocks)")
    ax.set_ylabel("token hit rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as exc:
        raise KVTierError(f"cannot write plot {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out
