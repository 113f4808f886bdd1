"""``kvtier plan --plot`` draws the numbers the report prints: the HBM KV pool counted once
per token, and the demand of the model as the connector runs it. (It drew every GPU's KV
room, 8 times the pool of an MLA model at TP 8, and the demand of windowed layers that the
engine, under the connector, allocates as full attention.)"""

from __future__ import annotations

import pytest

from kvtier.plan.hardware import find_gpu
from kvtier.plan.model import load_model
from kvtier.plan.planner import Plan, PlanInput, make_plan
from kvtier.plan.plot import plot_series


def _plan(model: str, gpus: int = 1, tp: int = 1, concurrency: int = 32) -> Plan:
    return make_plan(PlanInput(model=load_model(model), gpu=find_gpu("h200"), kv_dtype="bf16",
                               gpus=gpus, tp=tp, concurrency=concurrency))


@pytest.mark.parametrize(("model", "kw"), [
    ("deepseek-v3", {"gpus": 8, "tp": 8, "concurrency": 64}),   # MLA: latent on every rank
    ("gemma-2-9b", {"concurrency": 32}),                      # sliding-window layers
    ("llama-3-8b", {"gpus": 2, "tp": 1, "concurrency": 16}),  # two replicas
])
def test_the_plot_draws_the_reports_pool_and_p99_demand(model: str, kw: dict[str, int]) -> None:
    plan = _plan(model, **kw)
    xs, ys, pool = plot_series(plan)
    assert pool == plan.kv_pool_bytes / 1e9
    p99 = plan.sequence_tokens["p99"]
    below = max(i for i, x in enumerate(xs) if x <= p99)
    above = min(i for i, x in enumerate(xs) if x >= p99)
    demand = plan.kv_demand_bytes_p99 / 1e9
    assert ys[below] <= demand <= ys[above]
    assert ys == sorted(ys) and xs[-1] > p99


def test_an_mla_pool_at_tp8_is_not_eight_ranks_of_room() -> None:
    plan = _plan("deepseek-v3", gpus=8, tp=8, concurrency=64)
    _, _, pool = plot_series(plan)
    assert pool * 1e9 * 7 < plan.kv_budget_bytes_per_gpu * 8
