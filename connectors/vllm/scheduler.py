"""Scheduler-side half of the connector: lookups, load plans and save plans.

The scheduler never moves KV. It asks the daemon how many leading kvtier blocks of a
request exist (for every tensor-parallel rank: a block is only usable if all ranks have
their shard), plans which pages to fill from kvtier and which newly completed blocks to
offload, and hands those plans to the workers in the step's metadata.

Invariant per tracked request: blocks ``[0, known_blocks)`` are in kvtier or are being
loaded/saved this step; ``known_blocks`` only drops when a worker reports a failed load,
so those blocks are offloaded again once vLLM has recomputed them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.keys import block_keys
from kvtier.layout import KVLayout

from .config import ConnectorConfig
from .link import DaemonLink
from .mapping import LoadSpan, PageMap
from .metadata import KVTierConnectorMetadata, TransferSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.connectors.vllm")

REPORT_INTERVAL_S = 1.0


@dataclass(slots=True)
class RequestState:
    """What the scheduler side remembers about one live request."""

    request: Request
    salt: str | None
    page_ids: list[int] = field(default_factory=list)
    known_blocks: int = 0
    load: TransferSpec | None = None


def request_salt(request: Request) -> str | bool | None:
    """The namespace salt of a request, or ``False`` when its KV is not a function of its
    token ids alone (multimodal inputs, prompt embeddings) and must not be cached.

    A LoRA adapter changes the KV, so its name joins the tenant's ``cache_salt``.
    """
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) \
            is not None:
        return False
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        salt = f"{salt or ''}|lora:{lora.lora_name}"
    return salt


class SchedulerSide:
    """The scheduler half of ``KVTierConnector`` (one per engine core)."""

    def __init__(self, config: ConnectorConfig, layout: KVLayout, block_size: int,
                 tp_size: int) -> None:
        self.config = config
        self.pages = PageMap(block_size, config.tokens_per_block)
        self.tp_size = tp_size
        self.link = DaemonLink(config, layout, tp_size=tp_size, name="scheduler")
        self._states: dict[str, RequestState] = {}
        self._spans: dict[str, LoadSpan] = {}
        self._pending_loads: list[TransferSpec] = []
        self._preemptions = 0
        self._last_report = 0.0
        self.lookups = 0
        self.hit_tokens = 0

    # -- lookup ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens kvtier can add beyond ``num_computed_tokens`` (and whether they load
        asynchronously); 0 whenever the daemon is unreachable. Side-effect free for vLLM:
        it may call this again for a request it could not schedule."""
        self._spans.pop(request.request_id, None)
        salt = request_salt(request)
        if salt is False:
            return 0, False
        tokens = _token_ids(request)
        n_blocks = self.pages.full_blocks(len(tokens))
        if n_blocks * self.config.tokens_per_block <= num_computed_tokens:
            return 0, False
        hits = n_blocks
        for rank in range(self.tp_size):
            ns = self.link.namespace(salt, rank)  # type: ignore[arg-type]
            keys = block_keys(ns, tokens[: hits * self.config.tokens_per_block])
            hits = min(hits, self.link.lookup(ns, keys))
            if hits == 0:
                break
        self.lookups += 1
        span = self.pages.load_span(num_computed_tokens, hits, len(tokens))
        if span is None:
            return 0, False
        self._spans[request.request_id] = span
        return span.num_external_tokens, self.config.async_load

    # -- allocation and per-step plans ------------------------------------------------

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Track the request's pages; plan the load when vLLM accepted external tokens."""
        req_id = request.request_id
        state = self._states.get(req_id)
        if state is None:
            salt = request_salt(request)
            if salt is False:
                return
            state = RequestState(request, salt)  # type: ignore[arg-type]
            self._states[req_id] = state
        block_ids = blocks.get_block_ids()
        if block_ids and block_ids[0]:
            state.page_ids = list(block_ids[0])
        span = self._spans.pop(req_id, None)
        if num_external_tokens <= 0 or span is None:
            return
        rows = self.pages.block_pages(state.page_ids, span.first_block, span.end_block)
        if len(rows) != span.end_block - span.first_block:
            # vLLM allocated fewer pages than promised; load nothing, report the tail as
            # failed so the scheduler recomputes it (cannot happen with full attention).
            logger.warning("kvtier: request %s has %d pages for a %d-block load",
                           req_id, len(state.page_ids), span.end_block)
        tokens = np.asarray(_token_ids(request)[: span.end_block * self.config.tokens_per_block],
                            dtype=np.uint32)
        spec = TransferSpec(req_id, state.salt, tokens, span.first_block, rows, span.skip_pages)
        state.load = spec
        state.known_blocks = max(state.known_blocks, span.end_block)
        self._pending_loads.append(spec)
        self.hit_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierConnectorMetadata:
        """This step's loads (planned at allocation) and saves (blocks completed by it)."""
        meta = KVTierConnectorMetadata()
        for spec in self._pending_loads:
            (meta.async_loads if self.config.async_load else meta.loads).append(spec)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None:
                continue
            if new.block_ids and new.block_ids[0]:
                state.page_ids = list(new.block_ids[0])
            self._plan_save(meta, new.req_id, state,
                            new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._preemptions += 1
                state.page_ids = list(new_ids[0]) if new_ids else []
            elif new_ids is not None and new_ids[0]:
                state.page_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, state,
                            cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        self._maybe_report()
        return meta

    def _plan_save(self, meta: KVTierConnectorMetadata, req_id: str, state: RequestState,
                   computed_after_step: int) -> None:
        limit = computed_after_step
        if not self.config.save_decode_tokens:
            limit = min(limit, state.request.num_prompt_tokens)
        full = self.pages.full_blocks(limit)
        if full <= state.known_blocks:
            return
        rows = self.pages.block_pages(state.page_ids, state.known_blocks, full)
        if not rows:
            return
        end = state.known_blocks + len(rows)
        tokens = np.asarray(_token_ids(state.request)[: end * self.config.tokens_per_block],
                            dtype=np.uint32)
        meta.saves.append(TransferSpec(req_id, state.salt, tokens, state.known_blocks, rows))
        state.known_blocks = end

    # -- feedback from workers ---------------------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Forget blocks whose load failed so they are offloaded again after recompute."""
        invalid = set(output.invalid_block_ids or ())
        if not invalid:
            return
        for state in self._states.values():
            spec = state.load
            if spec is None:
                continue
            bad = self.pages.first_invalid_block(spec.page_ids, invalid)
            if bad is not None:
                state.known_blocks = min(state.known_blocks, spec.first_block + bad)
                state.load = None

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (done by the step that computed the block), so vLLM may
        free the pages at once."""
        self._states.pop(request.request_id, None)
        self._spans.pop(request.request_id, None)
        return False, None

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report < REPORT_INTERVAL_S or not self.link.connected:
            return
        self._last_report = now
        running, waiting, preempted = len(self._states), len(self._spans), self._preemptions
        self.link.call(lambda c: c.report_engine(running=running, waiting=waiting,
                                                 preemptions=preempted), None)

    def shutdown(self) -> None:
        self.link.close()


def _token_ids(request: Request) -> Any:
    """All token ids of the request (prompt, then output) as a sequence."""
    return request.all_token_ids
