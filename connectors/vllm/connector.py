"""KVTierConnector: kvtier as a vLLM v1 KV connector (vLLM 0.32).

Enable with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

vLLM builds one instance per role: the scheduler's (lookups, load and save plans) and one
per worker (the KV copies). This class only routes vLLM's calls to the half for its role
(:mod:`.scheduler`, :mod:`.worker`); the halves share nothing but the step metadata.

``kv_load_failure_policy="recompute"`` is strongly recommended: with vLLM's default
("fail") a block that disappears between lookup and load (daemon restart, eviction, a
checksum failure) fails the request instead of being recomputed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.errors import ConfigError

from .config import ConnectorConfig
from .geometry import (
    check_parallelism,
    context_loads,
    layout_from_kv_cache_config,
    tp_replicas,
    with_cache_dtype,
    with_engine_page_format,
)
from .metadata import KVTierConnectorMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier.layout import KVLayout

logger = logging.getLogger("kvtier.connectors.vllm")


class KVTierConnector(KVConnectorBase_V1):
    """Prefix reuse across requests, engine restarts and engines on one node, through
    the node's kvtier daemon."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        if kv_cache_config is None:
            raise ConfigError("KVTierConnector needs vLLM's KVCacheConfig (vLLM >= 0.32)")
        self.config = ConnectorConfig.from_vllm(vllm_config)
        parallel = vllm_config.parallel_config
        check_parallelism(parallel)
        layout, block_size = layout_from_kv_cache_config(kv_cache_config,
                                                         self.config.tokens_per_block)
        layout = with_cache_dtype(with_engine_page_format(layout, vllm_config, block_size),
                                  vllm_config)
        tp_size = parallel.tensor_parallel_size
        replicas = tp_replicas(kv_cache_config, layout, tp_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        asynchronous = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        if asynchronous and "async_load" not in extra:
            # vLLM caches a page loaded in the background only once the load succeeded; a
            # synchronous load that failed left its pages in vLLM's prefix cache under
            # async scheduling (its GPU default) when the request was aborted or preempted
            # first, and a later hit on them gave wrong tokens (found by review)
            self.config = replace(self.config, async_load=True)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, layout, block_size, tp_size,
                                            replicas,
                                            loads=self._loads(vllm_config, layout))
            # a rollback vLLM did not start itself crashes an engine that already scheduled
            # the next step on the request's sampled token (outcomes.py)
            self._scheduler.outcomes.stale_reports = not asynchronous
            if asynchronous and not self.config.async_load:
                logger.warning(
                    "kvtier: \"async_load\": false under vLLM's async scheduling: a page "
                    "whose load failed may stay in vLLM's prefix cache (policy "
                    "\"recompute\") if its request is aborted or preempted before it "
                    "recomputes it, and a later hit on it gives wrong tokens; leave "
                    "async_load unset (it loads in the background then)")
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if policy != "recompute":
                logger.warning("kvtier: kv_load_failure_policy=%r makes vLLM fail a request "
                               "whose cached KV vanished between lookup and load; set "
                               "\"kv_load_failure_policy\": \"recompute\"", policy)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
            self._worker = WorkerSide(self.config, layout, block_size, rank, tp_size,
                                      replicas=replicas)
        logger.info("kvtier: %s side, %s, socket %s, %d tokens per block, model_id %r, "
                    "tp %d", role.name.lower(), self.config.role, self.config.socket_path,
                    self.config.tokens_per_block, self.config.model_id, tp_size)

    def _loads(self, vllm_config: VllmConfig, layout: KVLayout) -> bool:
        """Whether the scheduler side loads (``context_reuse``); logged when it does not."""
        mode = self.config.context_reuse
        loads, why = context_loads(mode, vllm_config, layout)
        if loads:
            return True
        if self.config.saves:
            logger.warning("kvtier: this engine saves KV but never loads it "
                           "(context_reuse=%s%s)", mode, f": {why}" if why else "")
        else:
            logger.warning("kvtier: a kv_consumer never saves KV, and with context_reuse=%s "
                           "this one never loads it%s: the connector does nothing", mode,
                           f" ({why})" if why else "")
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is only a future miss: kvtier is a best-effort cache."""
        return False

    # -- worker side ---------------------------------------------------------------------

    def _w(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on the scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVTierConnectorMetadata):
            self._w().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer of the step's layer-pipelined loads only."""
        self._w().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Saves are queued at the end of the step (``wait_for_save``): a kvtier block
        holds every layer and its put lease commits once all are copied, so one gather per
        block on the saver thread/stream beats one per layer."""
        return

    def wait_for_save(self) -> None:
        """Join the step's loads and queue its saves; waits for them only in a
        ``kv_producer``, whose blocks must be in Redis before its requests are reported."""
        meta = self._connector_metadata
        if isinstance(meta, KVTierConnectorMetadata):
            self._w().save(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVTierConnectorMetadata) and \
                kv_connector_metadata.preempted:
            self._w().handle_preemptions(kv_connector_metadata.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        sending, recving = self._w().get_finished(finished_req_ids)
        return (sending or None), (recving or None)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w().worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_load_errors()

    def shutdown(self) -> None:
        for side in (self._worker, self._scheduler):
            if side is not None:
                side.shutdown()

    # -- scheduler side --------------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    def reset_cache(self) -> bool | None:
        """vLLM resets the connector's cache (after an in-place weight update): no KV saved
        before is loaded again (``SchedulerSide.reset_cache``)."""
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)
