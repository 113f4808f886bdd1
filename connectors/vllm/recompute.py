"""Never slower than recompute: how many of a request's matched blocks are worth loading.

A block found in a tier costs ``block_bytes / bandwidth(tier)`` seconds to reload, where
the bandwidth is what the daemon measured on its own recent transfers (returned with each
lookup) or what the operator configured for that tier. Recomputing it costs
``tokens_per_block / prefill_tokens_per_s`` seconds, from the engine's own measured prefill
throughput (an estimate until measured). A block whose reload is slower than its recompute
is not loaded, and neither is anything after it (the tokens after it must be recomputed
anyway, and their KV depends on it). Pure arithmetic, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PREFILL_ALPHA = 0.2
"""Weight of the newest prefill-throughput sample."""


@dataclass(slots=True)
class RecomputeModel:
    """Reload-versus-recompute decision for one engine."""

    tokens_per_block: int
    block_bytes: int
    prefill_tokens_per_s: float
    tier_bandwidth: dict[str, float] = field(default_factory=dict)
    measured_steps: int = 0
    warmup_steps: int = 1

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A forward step computed ``tokens`` tokens in ``seconds`` (prefill-sized steps
        only: a decode step measures per-step overhead, not prefill speed; the first
        ``warmup_steps`` of those are ignored, they include one-off start-up work)."""
        if tokens < self.tokens_per_block or seconds <= 0.0:
            return
        if self.warmup_steps > 0:
            self.warmup_steps -= 1
            return
        rate = tokens / seconds
        self.prefill_tokens_per_s = rate if self.measured_steps == 0 else (
            PREFILL_ALPHA * rate + (1.0 - PREFILL_ALPHA) * self.prefill_tokens_per_s)
        self.measured_steps += 1

    @property
    def recompute_s(self) -> float:
        """Seconds to recompute one block."""
        return self.tokens_per_block / self.prefill_tokens_per_s

    def reload_s(self, tier: str, measured: dict[str, float]) -> float | None:
        """Seconds to reload one block from ``tier`` (None: unknown, assumed fast)."""
        rate = self.tier_bandwidth.get(tier) or measured.get(tier)
        return self.block_bytes / rate if rate else None

    def worth_loading(self, tiers: Sequence[str], measured: dict[str, float],
                      start: int, hits: int) -> int:
        """How many of the leading ``hits`` blocks to use: all up to ``start`` (already
        computed locally, nothing to load), then up to the first block whose reload is
        slower than its recompute."""
        recompute = self.recompute_s
        for i in range(start, min(hits, len(tiers))):
            reload = self.reload_s(tiers[i], measured)
            if reload is not None and reload > recompute:
                return i
        return hits
