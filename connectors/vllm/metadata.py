"""What the scheduler-side connector tells the workers each step.

Specs carry token ids rather than block keys: keys depend on the tensor-parallel rank
(it is part of the namespace), which only the worker knows. Page ids are in the
request's logical order, one row of ``pages_per_block`` pages per kvtier block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # the worker side driven without vLLM (GPU device checks, benchmarks)
    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class."""


@dataclass(slots=True)
class TransferSpec:
    """Move kvtier blocks ``[first_block, first_block + len(pages))`` of one request.

    ``token_ids`` are the request's tokens from position 0 through the end of the last
    block (the key chain starts at the first token). For a load, ``skip_pages`` leading
    pages of the first block hold locally computed KV that must be kept as is.
    """

    req_id: str
    cache_salt: str | None
    token_ids: np.ndarray
    first_block: int
    pages: list[list[int]]
    skip_pages: int = 0
    save_id: int = -1
    # a save's (block, page, step) triples: the pages of its request's blocks up to its
    # end that a load fills whose outcome the scheduler has not seen (this step's, or with
    # vLLM's async scheduling the step before), the request's own load or another's that
    # vLLM's prefix cache shares with it; blocks from the first one whose page failed to
    # load on were computed on pages that do not hold the prompt's KV (pieces.py)
    loaded_pages: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.pages)

    @property
    def page_ids(self) -> list[int]:
        """All pages of the spec, flattened, in token order."""
        return [p for row in self.pages for p in row]


@dataclass(slots=True)
class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's work: loads to run during the forward, layer by layer (or in the
    background when ``async_loads``), saves to start after it, and the requests vLLM
    preempted this step (their pages may be reused: their saves must finish first)."""

    loads: list[TransferSpec] = field(default_factory=list)
    async_loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    step: int = -1   # the scheduler side's count of metadata built: names this step's loads
    # pages known not to hold their prompt's KV that a request of this step counts computed
    # (badpages.BadPages.relied_on): the workers report them as this step's load errors
    stale_pages: list[int] = field(default_factory=list)
    # requests vLLM finished whose saves every worker had acknowledged: their free was not
    # delayed, so the workers must not report them in finished_sending
    undelayed: list[str] = field(default_factory=list)
    # the scheduler side's model id and kv_format: what the workers name namespaces by
    # (WorkerSide.adopt: each side derives them in its own process, from a config vLLM's
    # model loading may change in the workers only)
    model_id: str = ""
    kv_format: str = ""


@dataclass(slots=True)
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers tell the scheduler side after a step: saves that are over
    (``save_id`` -> number of workers done with it, committed or dropped), counter
    increments (dropped saves and bytes, loaded and saved blocks), summed over workers,
    and the step whose loads every worker has finished (their failures are in the same
    output: the scheduler need not name those loads in later saves)."""

    saves_done: dict[int, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    step: int = -1

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        done = dict(self.saves_done)
        for k, v in other.saves_done.items():
            done[k] = done.get(k, 0) + v
        counters = dict(self.counters)
        for name, n in other.counters.items():
            counters[name] = counters.get(name, 0) + n
        return KVTierWorkerMetadata(done, counters, min(self.step, other.step))
