"""The scheduler side's periodic report to the daemon (``report_engine``).

The daemon turns these gauges into ``kvtier_engine_*`` metrics, and ``kvtier doctor``
reads the live requests' context lengths from them (its KV-pressure patterns).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


def engine_report(counters: Mapping[str, int], context_lengths: Iterable[int], *,
                  running: int, waiting: int, preemptions: int,
                  prefill_tokens_per_s: float) -> dict[str, float]:
    """The values of one report: cumulative counters (the daemon counts an engine once
    however often its link reconnects) and gauges of the moment."""
    values: dict[str, float] = {k: float(v) for k, v in counters.items()}
    values.update(running=running, waiting=waiting, preemptions=preemptions,
                  prefill_tokens_per_s=round(prefill_tokens_per_s, 1))
    lengths = np.fromiter(context_lengths, dtype=np.int64)
    if lengths.size:
        p50, p99 = np.percentile(lengths, (50, 99))
        values.update(context_tokens_p50=float(p50), context_tokens_p99=float(p99))
    else:
        values.update(context_tokens_p50=0.0, context_tokens_p99=0.0)
    return values
