"""How one step's saves are cut and split before the saver thread runs them.

A save stops before the first block of its request that holds a page whose load failed in
the step (what was computed on it is not the prompt's KV); a producer's save larger than
the bound on saves in flight goes in pieces that fit it, in chain order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .metadata import TransferSpec

FAILED_STEPS_KEPT = 8
"""Steps whose loads a save is checked against: the workers keep each step's failed pages,
and the scheduler side the pages of its loads, this long at most (it names those of the
steps it has not had the workers' output of: the step itself, with vLLM's async
scheduling the step before as well)."""

def first_failed_block(save: TransferSpec, failed: Mapping[int, set[int]]) -> int | None:
    """The first block of a ``save``'s request, up to the save's end, that holds a page
    whose load failed (``failed``: step -> its failed pages), or None."""
    if not failed:
        return None
    return min((block for block, page, step in save.loaded_pages
                if page in failed.get(step, ())), default=None)


def saved_before(spec: TransferSpec, cut: int | None, tokens_per_block: int
                 ) -> TransferSpec | None:
    """``spec`` (a save) cut to its blocks before ``cut`` (the request's first block with a
    page whose load failed this step: the KV of it and of every block computed after it in
    this step was computed on pages that did not hold the prompt's KV); None when nothing
    is left."""
    if cut is None or spec.end_block <= cut:
        return spec
    if spec.first_block >= cut:
        return None
    keep = cut - spec.first_block
    return dataclasses.replace(spec, token_ids=spec.token_ids[:cut * tokens_per_block],
                               pages=spec.pages[:keep])


def save_pieces(spec: TransferSpec, most: int, tokens_per_block: int) -> list[TransferSpec]:
    """``spec`` (a save) in pieces of at most ``most`` blocks, in chain order."""
    if len(spec.pages) <= most:
        return [spec]
    out = []
    for lo in range(0, len(spec.pages), most):
        end = spec.first_block + min(lo + most, len(spec.pages))
        out.append(dataclasses.replace(spec, first_block=spec.first_block + lo,
                                       pages=spec.pages[lo:lo + most],
                                       token_ids=spec.token_ids[:end * tokens_per_block],
                                       skip_pages=spec.skip_pages if lo == 0 else 0))
    return out
