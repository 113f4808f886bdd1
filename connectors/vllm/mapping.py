"""Mapping between vLLM pages and kvtier blocks (pure arithmetic, no I/O, no torch).

A kvtier block ``j`` holds tokens ``[j*T, (j+1)*T)`` of a request (``T`` =
``tokens_per_block``), i.e. the request's pages ``[j*r, (j+1)*r)`` in *logical* order
(``r = T // block_size``). vLLM hands a request's page ids in logical order but with
arbitrary physical values; page 0 is the null page and never holds KV, so a block that
would touch it is neither loaded nor saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError

NULL_PAGE = 0


@dataclass(frozen=True, slots=True)
class LoadSpan:
    """What to load for one request: kvtier blocks ``[first_block, end_block)``.

    ``skip_pages`` leading pages of ``first_block`` are already computed locally (vLLM's
    own prefix cache) and are preserved; ``num_external_tokens`` is what the scheduler is
    told (never the whole prompt: the last prompt token is always recomputed so vLLM has
    logits to sample from).
    """

    first_block: int
    end_block: int
    skip_pages: int
    num_external_tokens: int


@dataclass(frozen=True, slots=True)
class PageMap:
    """vLLM ``block_size`` (page) versus kvtier ``tokens_per_block``."""

    block_size: int
    tokens_per_block: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.tokens_per_block % self.block_size:
            raise ConfigError(f"tokens_per_block={self.tokens_per_block} must be a positive "
                              f"multiple of vLLM block_size={self.block_size}")

    @property
    def pages_per_block(self) -> int:
        return self.tokens_per_block // self.block_size

    def full_blocks(self, num_tokens: int) -> int:
        """Number of whole kvtier blocks in ``num_tokens`` tokens."""
        return max(0, num_tokens) // self.tokens_per_block

    def load_span(self, num_local_tokens: int, hit_blocks: int,
                  num_tokens: int) -> LoadSpan | None:
        """The load for a request with ``num_tokens`` tokens, ``num_local_tokens`` already
        computed by vLLM (a multiple of ``block_size``) and ``hit_blocks`` leading kvtier
        blocks present; ``None`` when kvtier adds nothing."""
        if num_local_tokens % self.block_size:
            return None
        end_token = min(hit_blocks * self.tokens_per_block, num_tokens - 1)
        external = end_token - num_local_tokens
        if external <= 0:
            return None
        first_block = num_local_tokens // self.tokens_per_block
        skip_pages = (num_local_tokens % self.tokens_per_block) // self.block_size
        end_block = -(-end_token // self.tokens_per_block)
        return LoadSpan(first_block, end_block, skip_pages, external)

    def block_pages(self, page_ids: Sequence[int], first_block: int,
                    end_block: int) -> list[list[int]]:
        """Page ids of kvtier blocks ``[first_block, end_block)``, one row per block,
        truncated before the first block that is not fully allocated or touches the null
        page (blocks after a hole are useless: lookups stop at the first miss)."""
        r = self.pages_per_block
        rows: list[list[int]] = []
        for j in range(first_block, end_block):
            row = list(page_ids[j * r:(j + 1) * r])
            if len(row) < r or NULL_PAGE in row:
                break
            rows.append(row)
        return rows
