"""What the scheduler side knows of its engine pages' KV between steps: the pages known
bad (``BadPages``), the loads whose outcome the workers have not reported yet, and the bad
pages it named to the workers itself.

Loads run in the workers; a failure comes back in a later step's invalid block ids, and
a success in the step the workers' metadata confirms. Meanwhile vLLM's prefix cache may
share a page being loaded, so a save that includes one names it (``mark_loaded``), and a
request that counts a bad page computed has it reported as that step's load error
(``report_stale``): vLLM keeps a failed load's pages in its prefix cache under the
``recompute`` policy, for the request it rolled back to rewrite them, and one aborted or
preempted before it did left them there: a later hit on them decoded on zeroed KV (found
by review).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from .badpages import BadPages
from .mapping import NULL_PAGE
from .metadata import KVTierConnectorMetadata
from .pieces import FAILED_STEPS_KEPT


class _Held(Protocol):
    page_ids: list[int]


class PageOutcomes:
    """Bad pages, loads not yet confirmed, and stale pages reported, of one engine."""

    def __init__(self, block_size: int, pages_per_block: int) -> None:
        self.bad = BadPages(block_size)   # pages no save may include (failed loads)
        # off under vLLM's async scheduling: step N+1 is scheduled on the token a request
        # samples in step N, and a rollback of that request from N's output (one vLLM did
        # not start itself) crashed the engine (found by review); vLLM's own rollback of a
        # failed load's request is left as it is
        self.stale_reports = True
        self.pages_per_block = pages_per_block
        # (step, pages) of synchronous loads whose step the workers have not reported yet
        self._unconfirmed: list[tuple[int, set[int]]] = []
        # bad pages named to the workers in recent steps: they come back in the step's
        # invalid block ids, and are no failure of the pages rewritten since
        self._stale_sent: list[set[int]] = []

    def report_stale(self, meta: KVTierConnectorMetadata,
                     computed: Iterable[tuple[_Held, int]]) -> None:
        """Name in ``meta`` the bad pages a request of this step counts computed (each with
        the tokens it counts computed before the step); pages a load of this step fills are
        left to that load's own outcome."""
        if not self.bad or not self.stale_reports:
            return
        loading = {p for spec in meta.loads for p in spec.page_ids[spec.skip_pages:]}
        stale: set[int] = set()
        for held, before in computed:
            stale.update(self.bad.relied_on(held.page_ids, before))
        meta.stale_pages = sorted(stale - loading)
        self._stale_sent.append(set(meta.stale_pages))
        del self._stale_sent[:-FAILED_STEPS_KEPT]

    def loads_planned(self, meta: KVTierConnectorMetadata) -> None:
        """This step's synchronous loads, unconfirmed until the workers report the step."""
        if meta.loads:
            self._unconfirmed.append(
                (meta.step, {p for spec in meta.loads for p in spec.page_ids[spec.skip_pages:]}))
            del self._unconfirmed[:-FAILED_STEPS_KEPT]   # (no worker output: not forever)

    def mark_loaded(self, meta: KVTierConnectorMetadata,
                    held_by: Callable[[str], Sequence[int] | None]) -> None:
        """Name, in each save, the pages of its request up to the save's end that loads
        fill whose outcome this side has not seen (this step's; with async scheduling the
        step before too): vLLM's prefix cache shares pages still being loaded, and the
        workers must not save what anyone computed on a load that failed. ``held_by(req_id)``:
        the pages of a live request."""
        if not self._unconfirmed or not meta.saves:
            return
        loading: dict[int, int] = {}   # page -> the latest step loading it
        for step, filled in self._unconfirmed:
            loading.update(dict.fromkeys(filled, step))
        ppb = self.pages_per_block
        for save in meta.saves:
            pages = held_by(save.req_id)
            held = None if pages is None else pages[:save.end_block * ppb]
            if held and not loading.keys().isdisjoint(held):   # (most saves: none)
                save.loaded_pages = [
                    (i // ppb, p, loading[p]) for i, p in enumerate(held) if p in loading]

    def confirmed(self, step: int) -> set[int]:
        """The workers finished the loads of steps up to ``step``: their pages."""
        if not self._unconfirmed or step < 0:
            return set()
        loaded: set[int] = set().union(*(p for s, p in self._unconfirmed if s <= step))
        self._unconfirmed = [(s, p) for s, p in self._unconfirmed if s > step]
        return loaded

    def failures(self, invalid: Iterable[int]) -> set[int]:
        """The pages of a step's invalid block ids that failed to load (this side's own
        stale reports are no news)."""
        failed = set(invalid)
        if failed and self._stale_sent:
            failed -= set().union(*self._stale_sent)
        return failed

    def not_loaded(self, page_ids: Sequence[int], first_block: int, end_block: int) -> None:
        """A load vLLM accepted for kvtier blocks ``[.., end_block)`` of a request holding
        ``page_ids`` has no whole row of real pages from ``first_block`` on (fewer pages, or
        a window's null page; not with full attention), so it stops short: the pages it
        holds there are bad, and are reported as load errors once the request counts them
        computed (``report_stale``), so vLLM recomputes them and no save includes them.
        (Under vLLM's async scheduling stale reports are off: the pages stay out of saves,
        but vLLM is not told; a geometry that could get here is refused before that.)"""
        ppb = self.pages_per_block
        held = [p for p in page_ids[first_block * ppb:end_block * ppb] if p != NULL_PAGE]
        if held:
            self.bad.failed(page_ids, {held[0]})
