"""The TP ranks' agreement on where saves stop (``ranks.tp_agree``), with vLLM's TP group
and torch's all-reduce stood in (mutation review survivors): the earliest cut of any
rank wins, a save no rank cut stays uncut, and the reduction runs on the TP group."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")
torch = pytest.importorskip("torch")

from kvtier.connectors.vllm.ranks import NO_CUT, tp_agree  # noqa: E402

from tests.support.vllm_fakes import fake  # noqa: E402


def other_rank(monkeypatch: pytest.MonkeyPatch, cuts: list[int | None]) -> list[Any]:
    """All-reduces as if one more rank held ``cuts``; returns the groups reduced over."""
    import torch.distributed as dist
    import vllm.distributed

    group = fake(cpu_group="tp-cpu-group")
    used: list[Any] = []

    def all_reduce(t: Any, op: Any = None, group: Any = None) -> None:
        used.append(group)
        theirs = torch.tensor([NO_CUT if c is None else c for c in cuts], dtype=t.dtype)
        pick = {dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum}[op]
        t.copy_(pick(t, theirs))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: group)
    return used


def test_the_earliest_cut_of_any_rank_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose load failed cuts its saves there: every rank saves only before that
    block (a later cut, or none, would save a shard computed on the failed one)."""
    used = other_rank(monkeypatch, [2, None, 7, None, 0])
    assert tp_agree([None, 3, 5, None, 4]) == [2, 3, 5, None, 0]
    assert used == ["tp-cpu-group"]


def test_no_cut_anywhere_stays_no_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    other_rank(monkeypatch, [None, None])
    assert tp_agree([None, None]) == [None, None]
