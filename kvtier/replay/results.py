"""What one replay measured, per tier and overall (:func:`kvtier.replay.simulator.simulate`
fills it; :mod:`kvtier.replay.report` prints it)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ReplayResult", "TierResult"]


@dataclass(slots=True)
class TierResult:
    """Per-tier outcome of one replay."""

    name: str
    capacity_blocks: int
    hit_tokens: int = 0
    hit_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    rejected: int = 0


@dataclass(slots=True)
class ReplayResult:
    """Outcome of replaying one trace with one policy and one set of capacities."""

    policy: str
    capacity_fraction: float | None
    order: str = "store"  # SimConfig.order the replay ran with ("store" | "reference")
    requests: int = 0
    references: int = 0
    total_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    orphans_dropped: int = 0
    late_blocks: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tiers: list[TierResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time for the replay (a loaded machine's wall
    # clock counts the time other processes had the cores too)
    # per REUSE_EDGES bucket (+1 open bucket): reuses seen and reuses hit; empty unless asked
    reuses_by_distance: list[int] = field(default_factory=list)
    hits_by_distance: list[int] = field(default_factory=list)
    # per tier (adaptive only): the shadows' snapshot at the end (mode, switches, MRC)
    shadows: list[dict[str, object]] = field(default_factory=list)

    @property
    def modes(self) -> list[str]:
        """The live mode of each tier at the end of the replay (adaptive only)."""
        return [str(s["mode"]) for s in self.shadows]

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.references if self.references else 0.0
