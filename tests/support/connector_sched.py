"""The connector's scheduler side driven directly in unit tests: a request, a scheduler side
whose daemon socket leads nowhere, lookups answered as a daemon holding some blocks would,
and one step's metadata (vLLM's objects stood in by ``vllm_fakes.fake``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake

if TYPE_CHECKING:   # (the connector package imports vLLM: tests importorskip it first)
    from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata
    from kvtier.connectors.vllm.scheduler import SchedulerSide

    from kvtier.keys import Namespace

PAGE, TPB = 32, 64   # vLLM's block_size, kvtier's tokens per block: 2 pages a block
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32",
                  tokens_per_block=TPB)
PROMPT = list(range(1, 4 * TPB + 2))   # 4 whole blocks and one more token


def request(rid: str, ids: list[int], **extra: Any) -> Any:
    """A text request of prompt ``ids`` (``extra``: other fields, e.g. a cache salt)."""
    fields: dict[str, Any] = dict(
        request_id=rid, all_token_ids=ids, num_prompt_tokens=len(ids), num_tokens=len(ids),
        cache_salt=None, mm_features=None, prompt_embeds=None, lora_request=None)
    fields.update(extra)
    return fake(**fields)


def scheduler(tmp_path: Path, *, loads: bool = True, tp_size: int = 1,
              role: str | None = None, **extra: Any) -> SchedulerSide:
    """A scheduler side whose daemon socket leads nowhere (``extra``: connector config)."""
    from kvtier.connectors.vllm.config import ConnectorConfig
    from kvtier.connectors.vllm.scheduler import SchedulerSide

    cfg = ConnectorConfig.from_extra({"socket_path": str(tmp_path / "none.sock"),
                                      "tokens_per_block": TPB, "model_id": "m", **extra},
                                     block_size=PAGE, default_model_id="m", role=role)
    return SchedulerSide(cfg, LAYOUT, PAGE, tp_size, loads=loads)


def daemon_holds(monkeypatch: pytest.MonkeyPatch, hits: int | None = None, *,
                 tiers: list[str] | None = None, bandwidth: dict[str, float] | None = None,
                 per_rank: dict[Namespace, int] | None = None) -> list[Namespace]:
    """Lookups answered as a daemon holding the first ``hits`` blocks (all when None)
    would, no presence filter; ``per_rank``: hits by namespace (a shard's). Returns the
    namespaces asked, in order."""
    from kvtier.connectors.vllm.link import DaemonLink

    asked: list[Namespace] = []

    def lookup(self: DaemonLink, ns: Namespace, keys: list[Any]) -> Any:
        asked.append(ns)
        n = len(keys) if hits is None else min(len(keys), hits)
        if per_rank is not None:
            n = min(n, per_rank.get(ns, n))
        return fake(hits=n, tiers=(tiers or ["cpu"] * len(keys))[:len(keys)],
                    bandwidth=bandwidth or {})

    monkeypatch.setattr(DaemonLink, "leading_bound", lambda self, keys: None)
    monkeypatch.setattr(DaemonLink, "lookup_result", lookup)
    return asked


def step(sched: SchedulerSide, work: dict[str, tuple[int, int]], *,
         preempted: tuple[str, ...] = (), new_ids: dict[str, list[int]] | None = None,
         resumed: tuple[str, ...] = ()) -> KVTierConnectorMetadata:
    """One step's metadata: each request of ``work`` (all running already) computes ``n``
    tokens from ``computed``; ``new_ids``: pages allocated to a request in the step."""
    ids = list(work)
    return sched.build_connector_meta(fake(
        preempted_req_ids=list(preempted),
        num_scheduled_tokens={r: n for r, (_, n) in work.items()},
        total_num_scheduled_tokens=sum(n for _, n in work.values()), scheduled_new_reqs=[],
        scheduled_cached_reqs=fake(
            req_ids=ids, new_block_ids=[(new_ids[r],) if new_ids and r in new_ids else None
                                        for r in ids],
            resumed_req_ids=set(resumed), num_computed_tokens=[c for c, _ in work.values()])))
