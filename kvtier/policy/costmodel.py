"""What a block is worth in seconds: prefill recompute vs. reload from a tier.

Recompute cost is the prefill FLOPs of the chunk at its position in the prompt: the
dense part (2 x parameters per token) is the same for every chunk, the attention part
grows linearly with position, so late chunks of long prompts cost more to rebuild.
Reload cost is the block's bytes over the source tier's bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Prefill compute of a decoder-only transformer (defaults: an 8B, Llama-3-like model).

    ``flops_per_s`` is the effective throughput of the serving GPU during prefill
    (peak x utilisation).
    """

    params: float = 8.0e9
    layers: int = 32
    hidden: int = 4096
    flops_per_s: float = 4.0e14

    def __post_init__(self) -> None:
        if not self.flops_per_s > 0:  # NaN too: every cost would be NaN
            raise ValueError(f"flops_per_s must be positive, got {self.flops_per_s}")
        for name in ("params", "layers", "hidden"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    def flops(self, start: int, end: int) -> float:
        """FLOPs to prefill tokens ``[start, end)`` given the ``start`` tokens before them.

        Dense: 2 x params per token. Attention (QK^T and AV, 2 FLOPs per MAC): 4 x layers x
        hidden x position per token, summed over positions: 2 x layers x hidden x (end^2 -
        start^2).
        """
        if end <= start:
            return 0.0
        dense = 2.0 * self.params * (end - start)
        attn = 2.0 * self.layers * self.hidden * (float(end) * end - float(start) * start)
        return dense + attn

    def seconds(self, start: int, end: int) -> float:
        """Seconds to prefill tokens ``[start, end)``."""
        return self.flops(start, end) / self.flops_per_s


@dataclass(frozen=True, slots=True)
class BlockCosts:
    """Per-block costs of one deployment: chunk size, bytes and the prefill model."""

    block_tokens: int = 256
    block_bytes: int = 256 * 131072
    prefill: PrefillModel = field(default_factory=PrefillModel)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.block_bytes < 0:
            raise ValueError(f"block_bytes must not be negative, got {self.block_bytes}")

    def recompute_s(self, depth: int, tokens: int | None = None, *,
                    block_tokens: int | None = None) -> float:
        """Seconds to recompute the chunk at 0-based ``depth`` (``tokens`` if partial) of a
        namespace whose blocks hold ``block_tokens`` tokens (default: ``self.block_tokens``,
        a sizing default until the namespace's layout is known)."""
        bt = block_tokens or self.block_tokens
        start = depth * bt
        n = bt if tokens is None else tokens
        return self.prefill.seconds(start, start + n)

    def reload_s(self, nbytes: int, bandwidth: float | None) -> float:
        """Seconds to reload ``nbytes`` at ``bandwidth`` B/s; infinite if there is no tier."""
        if bandwidth is None or bandwidth <= 0:
            return float("inf")
        return nbytes / bandwidth
