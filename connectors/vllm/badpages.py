"""Pages whose KV is not their prompt's, as the scheduler side knows it, until rewritten.

A page whose load failed holds whatever was there before, and every page a request
computed after it (its attention read the bad one) is no better. vLLM recomputes, but only
the first request it finds holding a failed page rolls back; the others sharing that page
through the prefix cache count it computed and rely on the first to rewrite it, which an
abort, a preemption or a per-step prefill cap can delay or prevent. So no save may include
such a page, whichever request saves it, until a step writes the page whole again.
"""

from __future__ import annotations

from collections.abc import Sequence


class BadPages:
    """The engine's pages known not to hold their prompt's KV (vLLM ``block_size`` pages)."""

    __slots__ = ("block_size", "pages")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pages: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.pages)

    def failed(self, page_ids: Sequence[int], invalid: set[int]) -> int | None:
        """A request holding ``page_ids`` (in its logical order): the index of its first
        page in ``invalid`` (failed loads), that page and every later one marked bad; None
        when it holds none."""
        for i, page in enumerate(page_ids):
            if page in invalid:
                self.pages.update(page_ids[i:])
                return i
        return None

    def rewritten(self, page_ids: Sequence[int], before: int, after: int) -> None:
        """A request's step computes its tokens ``[before, after)``. On a sound prefix, the
        pages it writes whole hold their prompt's KV again (one written in part keeps its
        state); on a bad prefix (a bad page before ``before``, or the page ``before`` lies
        in), every page it writes is computed on bad KV: bad too."""
        if not self.pages:
            return
        bs = self.block_size
        first = before // bs
        prefix = page_ids[:first + (1 if before % bs else 0)]
        if not self.pages.isdisjoint(prefix):
            self.pages.update(page_ids[first:-(-after // bs)])
            return
        for j in range(-(-before // bs), min(after // bs, len(page_ids))):
            self.pages.discard(page_ids[j])

    def first(self, page_ids: Sequence[int], upto: int) -> int | None:
        """The index of the first bad page among ``page_ids[:upto]``, or None."""
        if not self.pages:
            return None
        for i, page in enumerate(page_ids[:upto]):
            if page in self.pages:
                return i
        return None
