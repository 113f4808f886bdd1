"""Old home of ``kvtier.tiers.aligned`` (kept so existing imports work; import from there)."""

from kvtier.tiers.aligned import PAGE, address_of, aligned_buffer, byte_view, is_aligned, round_up

__all__ = ["PAGE", "address_of", "aligned_buffer", "byte_view", "is_aligned", "round_up"]
