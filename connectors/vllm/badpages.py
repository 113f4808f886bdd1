"""Pages whose KV is not their prompt's, as the scheduler side knows it, until rewritten.

A page whose load failed holds whatever was there before, and every page a request
computed after it (its attention read the bad one) is no better. vLLM recomputes, but only
the first request it finds holding a failed page rolls back; the others sharing that page
through the prefix cache count it computed and rely on the first to rewrite it, which an
abort, a preemption or a per-step prefill cap can delay or prevent. So no save may include
such a page, whichever request saves it, until it is written whole again or loaded; and a
request that counts one computed (a prefix-cache hit on it, a sharer) has it reported as a
load error in that step (``relied_on``), so that vLLM rolls that request back too.
"""

from __future__ import annotations

from collections.abc import Sequence


class BadPages:
    """The engine's pages known not to hold their prompt's KV (vLLM ``block_size`` pages).

    A bad page is good again once a load into it succeeds, or once a request writes it
    whole on a sound prefix, from its first token, in one step or over several (a chunked
    prefill or a decode ends a step mid-page: ``_upto`` keeps how far it got)."""

    __slots__ = ("_upto", "block_size", "pages")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pages: set[int] = set()
        self._upto: dict[int, int] = {}   # bad page -> tokens of it rewritten so far

    def __bool__(self) -> bool:
        return bool(self.pages)

    def _mark(self, pages: Sequence[int]) -> None:
        self.pages.update(pages)
        for page in pages:
            self._upto.pop(page, None)

    def _clear(self, page: int) -> None:
        self.pages.discard(page)
        self._upto.pop(page, None)

    def failed(self, page_ids: Sequence[int], invalid: set[int]) -> int | None:
        """A request holding ``page_ids`` (in its logical order): the index of its first
        page in ``invalid`` (failed loads), that page and every later one marked bad; None
        when it holds none."""
        for i, page in enumerate(page_ids):
            if page in invalid:
                self._mark(page_ids[i:])
                return i
        return None

    def loaded(self, pages: set[int]) -> None:
        """Loads into ``pages`` succeeded: they hold their prompt's KV."""
        if self.pages:
            for page in pages & self.pages:
                self._clear(page)

    def rewritten(self, page_ids: Sequence[int], before: int, after: int) -> None:
        """A request's step computes its tokens ``[before, after)`` into its pages. On a
        sound prefix a bad page it writes from its first token (now or over earlier steps)
        to its last is good again; on a bad prefix every page it writes is bad."""
        if not self.pages:
            return
        bs = self.block_size
        j0 = before // bs
        sound = self.pages.isdisjoint(page_ids[:j0])
        for j in range(j0, min(-(-after // bs), len(page_ids))):
            page = page_ids[j]
            if not sound:
                self._mark((page,))
                continue
            lo, hi = max(before - j * bs, 0), min(after - j * bs, bs)
            if page in self.pages and (lo == 0 or self._upto.get(page) == lo):
                if hi == bs:
                    self._clear(page)
                else:
                    self._upto[page] = hi
            sound = page not in self.pages

    def relied_on(self, page_ids: Sequence[int], computed: int) -> list[int]:
        """The bad pages a request holding ``page_ids`` reads as computed when it counts
        ``computed`` tokens so: a page rewritten up to some token is relied on only past it
        (a request rewriting it a step at a time reads what it wrote)."""
        if not self.pages:
            return []
        bs = self.block_size
        held = page_ids[:-(-computed // bs)]
        if self.pages.isdisjoint(held):
            return []
        return [page for j, page in enumerate(held)
                if page in self.pages and computed > j * bs + self._upto.get(page, 0)]

    def first(self, page_ids: Sequence[int], upto: int) -> int | None:
        """The index of the first bad page among ``page_ids[:upto]``, or None."""
        if not self.pages:
            return None
        for i, page in enumerate(page_ids[:upto]):
            if page in self.pages:
                return i
        return None
