"""Scheduler-side half of the connector: lookups, load plans and save plans.

The scheduler never moves KV. It asks the daemon how many leading kvtier blocks of a
request exist (a block is usable only if every TP shard of it is), plans which pages to
fill from kvtier and which newly completed blocks to offload, and hands those plans to the
workers in the step's metadata. Per tracked request, blocks ``[0, known_blocks)`` are in
kvtier or being loaded or saved; ``known_blocks`` drops only when a load fails, so those
blocks are saved again once vLLM recomputed them. A request whose saves may still read its
pages is freed when the workers report them over (``delay_free``); a lookup whose next
block is being saved answers "not yet" for a bounded time (:mod:`.pending`); only blocks
faster to reload than to recompute are loaded (:mod:`.recompute`); the leading blocks of
every TP shard are found by :mod:`.lookup`. A ``kv_consumer`` plans no saves; a
``kv_producer`` saves every full prompt block (docs/pd-disaggregation.md).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.layout import KVLayout

from .config import ConnectorConfig
from .link import DaemonLink
from .loadpages import LoadPages
from .lookup import leading_blocks
from .mapping import LoadSpan, PageMap
from .metadata import KVTierConnectorMetadata, KVTierWorkerMetadata, TransferSpec
from .outcomes import PageOutcomes
from .pending import PendingSaves
from .recompute import RecomputeModel
from .report import engine_report
from .salts import request_salt

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
    saved_any: bool = False
    save_ids: list[int] = field(default_factory=list)   # its saves since it last (re)started
    load_failed: bool = False   # a load of it failed: it recomputes, kvtier is not asked again
    reset: bool = False   # in flight at a cache reset, or its LoRA adapter changed on
    # disk: kvtier neither loads nor saves it


class SchedulerSide:
    """The scheduler half of ``KVTierConnector`` (one per engine core)."""

    def __init__(self, config: ConnectorConfig, layout: KVLayout, block_size: int,
                 tp_size: int, replicas: int = 1, *, loads: bool = True) -> None:
        """``replicas``: consecutive TP ranks holding the same KV (``geometry.
        tp_replicas``); ``loads``: False when this engine must not compute on a loaded
        context (``ConnectorConfig.context_reuse``)."""
        self.config = config
        self.pages = PageMap(block_size, config.tokens_per_block)
        self.tp_size = tp_size
        self.loads = loads
        self.link = DaemonLink(config, layout, tp_size=tp_size, replicas=replicas,
                               name="scheduler")
        self._states: dict[str, RequestState] = {}
        self._spans: dict[str, LoadSpan] = {}
        self._pending_loads: list[TransferSpec] = []
        self._load_pages = LoadPages()   # the pages of each state's ``load``
        self._undelayed: list[str] = []   # finished, saves all over: not delayed (metadata)
        self._preemptions = 0
        self._last_report = 0.0
        self.lookups = 0
        self.hit_tokens = 0
        self.recompute = RecomputeModel(config.tokens_per_block, layout.block_bytes,
                                        config.prefill_tokens_per_s,
                                        dict(config.tier_bandwidth))
        self._skips: dict[str, int] = {}
        self._pending_saves = PendingSaves(tp_size, config.tokens_per_block)
        self.outcomes = PageOutcomes(block_size, self.pages.pages_per_block)
        self._bad = self.outcomes.bad   # pages no save may include (failed loads)
        self._step = 0   # metadata built so far (KVTierConnectorMetadata.step)
        self._step_started: tuple[float, int] | None = None
        # names this engine in its reports: its counters are cumulative since it started,
        # and the daemon counts them once however often the link reconnects
        self.engine_id = uuid.uuid4().hex
        # names the weights after an in-place replacement (reset_cache): in every salt
        self.generation: str | None = None
        self.counters: dict[str, int] = {"skipped_slower_than_recompute": 0,
                                         "skipped_tokens_slower_than_recompute": 0,
                                         "lookups_without_round_trip": 0,
                                         "lookups_prefix_read_off": 0}
        self.link.preconnect()   # at engine start, not in the first request's lookup

    # -- lookup ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvtier can add beyond ``num_computed_tokens`` (and whether they load
        asynchronously); 0 whenever the daemon is unreachable. Side-effect free for vLLM:
        it may call this again for a request it could not schedule."""
        self._spans.pop(request.request_id, None)
        if not self.loads:
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):
            # prompt logprobs (or a pooling request) need every prompt token computed:
            # vLLM drops any hit, so a lookup would only start promotions and wait on saves
            self.counters["lookups_prefix_read_off"] += 1
            return 0, False
        salt = request_salt(request, self.generation)
        if salt is False:
            return 0, False
        state = self._states.get(request.request_id)
        if state is not None and (state.load_failed or state.reset):
            # vLLM asks again after a failed load: a stalled daemon would cost this request
            # a second timeout (another connection finds the stall anew), a lost block a
            # second failure; recomputing is what the failure already decided
            return 0, False
        tokens = request.all_token_ids
        n_blocks = self.pages.full_blocks(len(tokens))
        if n_blocks * self.config.tokens_per_block <= num_computed_tokens:
            return 0, False
        start = num_computed_tokens // self.config.tokens_per_block
        found = leading_blocks(
            self.link, self.recompute if self.config.skip_slower_than_recompute else None,
            salt, tokens, n_blocks, start, self.config.tokens_per_block,
            presence_filter=self.config.presence_filter)
        hits, usable = found.hits, found.usable
        if found.filtered:
            self.counters["lookups_without_round_trip"] += 1
        self.lookups += 1
        if hits < n_blocks and self._pending_saves.holds(salt, tokens, max(hits, start)):
            return None, False   # the next block is being saved: ask again next step
        skipped = max(0, hits - max(usable, start))
        span = self.pages.load_span(num_computed_tokens, min(hits, usable), len(tokens))
        if skipped:
            self._skips[request.request_id] = skipped
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
            salt = request_salt(request, self.generation)
            if salt is False:
                return
            state = RequestState(request, salt)
            self._states[req_id] = state
        block_ids = blocks.get_block_ids()
        if block_ids and block_ids[0]:
            state.page_ids = list(block_ids[0])
        span = self._spans.pop(req_id, None)
        skipped = self._skips.pop(req_id, 0)
        if skipped:
            self.counters["skipped_slower_than_recompute"] += skipped
            self.counters["skipped_tokens_slower_than_recompute"] += \
                skipped * self.config.tokens_per_block
        if num_external_tokens <= 0 or span is None:
            return
        rows = self.pages.block_pages(state.page_ids, span.first_block, span.end_block)
        end_block = span.first_block + len(rows)
        if end_block != span.end_block:   # (not with full attention: outcomes.not_loaded)
            logger.warning("kvtier: request %s has %d pages for a %d-block load: blocks "
                           "from %d recomputed", req_id, len(state.page_ids), span.end_block,
                           end_block)
            self.outcomes.not_loaded(state.page_ids, end_block, span.end_block)
            if not rows:
                return
        tokens = np.asarray(request.all_token_ids[: end_block * self.config.tokens_per_block],
                            dtype=np.uint32)
        spec = TransferSpec(req_id, state.salt, tokens, span.first_block, rows, span.skip_pages)
        # an older load into its fresh pages (this request's alone) is over: its request
        # was preempted and gave them up; their load errors are this request's from now on
        for rid in self._load_pages.holders(spec.page_ids[spec.skip_pages:]):
            other = self._states.get(rid)
            if other is not None:
                other.load = None
            self._load_pages.drop(rid)
        state.load = spec
        self._load_pages.add(req_id, spec.page_ids)
        if not self.config.producer:
            state.known_blocks = max(state.known_blocks, end_block)
        # a producer saves the loaded prefix too: its put skips the blocks the daemon has
        # (no copy) and its synchronous commit makes the whole chain visible in Redis
        self._pending_loads.append(spec)
        tpb, page = self.config.tokens_per_block, self.pages.block_size
        self.hit_tokens += min(num_external_tokens,
                               (end_block - span.first_block) * tpb - span.skip_pages * page)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierConnectorMetadata:
        """This step's loads (planned at allocation) and saves (blocks completed by it)."""
        meta = KVTierConnectorMetadata()
        meta.preempted = list(getattr(scheduler_output, "preempted_req_ids", None) or ())
        waits_for_saves = False   # the workers wait for a preempted request's saves
        for req_id in meta.preempted:
            state = self._states.get(req_id)
            if state is not None:
                waits_for_saves |= state.saved_any
                state.page_ids = []   # given up: vLLM may hand them to others this step
                # the workers wait for its saves now (handle_preemptions) and forget them:
                # its free waits only for saves after it resumes (vLLM delays the free of a
                # request aborted while loading for the load: reported sent, freed twice)
                state.saved_any = False
                state.save_ids = []
        meta.undelayed, self._undelayed = self._undelayed, []
        started = time.monotonic()
        for spec in self._pending_loads:
            (meta.async_loads if self.config.async_load else meta.loads).append(spec)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        # the step's requests, their pages brought up to date: (id, state, computed before)
        steps: list[tuple[str, RequestState, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None:
                continue
            if new.block_ids and new.block_ids[0]:
                state.page_ids = list(new.block_ids[0])
            steps.append((new.req_id, state, new.num_computed_tokens))
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
            steps.append((req_id, state, cached.num_computed_tokens[i]))
        self.outcomes.report_stale(meta, ((state, before) for _, state, before in steps))
        # the step's writes first (a page one request rewrites is sound for all), then saves
        if self._bad.pages:
            for req_id, state, before in steps:
                self._bad.rewritten(state.page_ids, before, before + scheduled.get(req_id, 0))
        if self.config.saves:   # (kv_consumer: loads only)
            for req_id, state, before in steps:
                self._plan_save(meta, req_id, state, before + scheduled.get(req_id, 0))
        meta.step = self._step
        meta.model_id, meta.kv_format = self.config.model_id, self.link.layout.kv_format
        self._step += 1
        self.outcomes.loads_planned(meta)
        self.outcomes.mark_loaded(meta, self._pages_of)
        # the step times prefill only when the workers do not wait on kvtier in it: a
        # synchronous load, or a producer's synchronous saves (a failover's seconds read as
        # a prefill of 361 tokens/s), would make recomputing look slower than it is
        waits = bool(meta.loads) or waits_for_saves or (
            self.config.producer and bool(meta.saves))
        self._step_started = None if waits else (
            started, scheduler_output.total_num_scheduled_tokens)
        self._maybe_report()
        return meta

    def _pages_of(self, req_id: str) -> list[int] | None:
        state = self._states.get(req_id)
        return None if state is None else state.page_ids

    def _plan_save(self, meta: KVTierConnectorMetadata, req_id: str, state: RequestState,
                   computed_after_step: int) -> None:
        if state.reset:
            return
        # KV of the request's tokens only: a speculative step also computes its draft
        # tokens' positions, which are not in all_token_ids (they may be rejected), so a
        # block ending among them holds KV of no known token (found by review)
        limit = min(computed_after_step, len(state.request.all_token_ids))
        if not self.config.save_decode_tokens:
            limit = min(limit, state.request.num_prompt_tokens)
        if limit < (state.known_blocks + 1) * self.config.tokens_per_block:
            return   # no new whole block (most requests of a decode step)
        if getattr(state.request, "lora_request", None) is not None and \
                request_salt(state.request, self.generation) != state.salt:
            state.reset = True   # its adapter changed on disk: KV of either version
            return
        full = self.pages.full_blocks(limit)
        ppb = self.pages.pages_per_block
        bad = self._bad.first(state.page_ids, full * ppb)
        if bad is not None:   # not its prompt's KV until rewritten: saved after that
            full = min(full, bad // ppb)
        if full <= state.known_blocks:
            return
        rows = self.pages.block_pages(state.page_ids, state.known_blocks, full)
        if not rows:
            return
        end = state.known_blocks + len(rows)
        tokens = np.asarray(state.request.all_token_ids[: end * self.config.tokens_per_block],
                            dtype=np.uint32)
        save_id = self._pending_saves.add(state.salt, tokens, state.known_blocks, end)
        meta.saves.append(TransferSpec(req_id, state.salt, tokens, state.known_blocks, rows,
                                       save_id=save_id))
        state.saved_any = True
        state.save_ids.append(save_id)
        state.known_blocks = end

    # -- feedback from workers ---------------------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Time the step, take the workers' save acknowledgements and counters, and forget
        blocks whose load failed so they are offloaded again after recompute."""
        if self._step_started is not None:
            t0, tokens = self._step_started
            self._step_started = None
            self.recompute.observe_step(tokens, time.monotonic() - t0)
        wmeta = getattr(output, "kv_connector_worker_meta", None)
        loaded = (self._take_worker_meta(wmeta) if isinstance(wmeta, KVTierWorkerMetadata)
                  else set())
        invalid = self.outcomes.failures(output.invalid_block_ids or ())
        ppb = self.pages.pages_per_block
        for state in self._states.values() if invalid else ():
            # a request holding a failed page (its own load's or a shared one): its saves from
            # there were dropped, and are planned again once the pages are sound (BadPages)
            bad = self._bad.failed(state.page_ids, invalid)
            if bad is not None:
                state.known_blocks = min(state.known_blocks, bad // ppb)
            if state.load is not None and not invalid.isdisjoint(state.load.page_ids):
                state.load = None   # (its pages are the request's: marked above)
                state.load_failed = True
                self._load_pages.drop(state.request.request_id)
        self._bad.loaded(loaded - invalid)

    def _take_worker_meta(self, wmeta: KVTierWorkerMetadata) -> set[int]:
        """Take the workers' report; the pages of the loads of the steps it confirms."""
        loaded = self.outcomes.confirmed(wmeta.step)
        self._pending_saves.acked(wmeta.saves_done)
        for name, n in wmeta.counters.items():
            self.counters[name] = self.counters.get(name, 0) + n
        return loaded

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """A request whose saves may still be reading its pages keeps them until the
        workers report it in ``finished_sending``. One whose saves every worker has
        acknowledged is freed at once: an idle in-process engine runs no step to report
        it, and vLLM's cache reset (sleep, a weight update) failed on its held pages
        (found by review)."""
        state = self._states.pop(request.request_id, None)
        self._load_pages.drop(request.request_id)
        self._spans.pop(request.request_id, None)
        self._skips.pop(request.request_id, None)
        delay = state is not None and state.saved_any
        if delay and state is not None and self._pending_saves.over(state.save_ids):
            delay = False
            self._undelayed.append(request.request_id)
        if not self._states:   # going idle: no step follows to report the last counts
            self._maybe_report(force=True)
        return delay, None

    def _maybe_report(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if (not force and now - self._last_report < REPORT_INTERVAL_S) or \
                not self.link.connected:
            return
        self._last_report = now
        self._pending_saves.prune(now)
        values = engine_report(
            self.counters, (s.request.num_tokens for s in self._states.values()),
            running=len(self._states), waiting=len(self._spans),
            preemptions=self._preemptions,
            prefill_tokens_per_s=self.recompute.prefill_tokens_per_s)
        # no round trip inside the engine's step: the reply is skipped by the next call
        self.link.call(lambda c: c.report_engine_nowait(engine_id=self.engine_id, **values),
                       None)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: what its weight-update flow
        calls once the weights changed in place (the files, and the fingerprint in the model
        id, may not have). The connector ignored it: the engine went on loading the old
        weights' KV and gave wrong tokens (found by review). Every later request keys a
        new, random weights generation: nothing saved before is loaded again, here or by
        another engine, and nothing computed from now on is saved under the old names.
        Requests in flight hold KV of either weights: kvtier neither loads nor saves them
        again; saves and loads already planned finish under the names they had."""
        self.generation = uuid.uuid4().hex
        for state in self._states.values():
            state.reset = True
        self._spans.clear()
        self._skips.clear()
        logger.info("kvtier: the engine's cache was reset (its weights may have changed): "
                    "KV saved before is not loaded again")
        return True

    def shutdown(self) -> None:
        self.link.close()

