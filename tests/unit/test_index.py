"""BlockMeta's slot state machine and residency properties; BlockIndex prefix walks."""

from __future__ import annotations

import itertools

import pytest

from kvtier.errors import KVTierError
from kvtier.index import BlockIndex, BlockMeta, SlotState
from kvtier.tiers.nvme import NvmeSlot

LEGAL = {
    (SlotState.NONE, SlotState.WRITING),
    (SlotState.NONE, SlotState.LOADING),
    (SlotState.WRITING, SlotState.READY),
    (SlotState.LOADING, SlotState.READY),
    (SlotState.WRITING, SlotState.NONE),
    (SlotState.LOADING, SlotState.NONE),
    (SlotState.READY, SlotState.NONE),
}


SLOT = NvmeSlot(4096, 0)   # a frame's slot (only whether there is one matters here)


def meta(key: int = 0, state: SlotState = SlotState.NONE, *, nvme: NvmeSlot | None = None,
         nvme_ready: bool = False) -> BlockMeta:
    m = BlockMeta(key.to_bytes(16, "little"), b"n" * 16, 1, 4096, None, 0, nvme=nvme,
                  nvme_ready=nvme_ready)
    m.cpu_state = state
    return m


@pytest.mark.parametrize(("old", "new"), sorted(itertools.product(SlotState, SlotState)),
                         ids=lambda s: s.value)
def test_transitions(old: SlotState, new: SlotState) -> None:
    m = meta(state=old)
    if (old, new) in LEGAL:
        m.set_cpu_state(new)
        assert m.cpu_state is new
    else:
        with pytest.raises(KVTierError, match="illegal cpu slot transition"):
            m.set_cpu_state(new)
        assert m.cpu_state is old


def test_put_and_promotion_paths() -> None:
    put = meta()
    for s in (SlotState.WRITING, SlotState.READY, SlotState.NONE):
        put.set_cpu_state(s)
    load = meta()
    for s in (SlotState.LOADING, SlotState.READY):
        load.set_cpu_state(s)
    assert put.cpu_state is SlotState.NONE and load.in_cpu


@pytest.mark.parametrize(("state", "nvme", "ready", "in_cpu", "in_nvme", "present", "where"), [
    (SlotState.NONE, None, False, False, False, False, "none"),
    (SlotState.WRITING, None, False, False, False, False, "none"),
    (SlotState.LOADING, None, False, False, False, True, "cpu"),
    (SlotState.READY, None, False, True, False, True, "cpu"),
    (SlotState.NONE, SLOT, False, False, False, False, "none"),   # write still in flight
    (SlotState.NONE, SLOT, True, False, True, True, "nvme"),
    (SlotState.READY, SLOT, True, True, True, True, "cpu"),
    (SlotState.WRITING, SLOT, True, False, True, True, "nvme"),
])
def test_residency(state: SlotState, nvme: NvmeSlot | None, ready: bool, in_cpu: bool,
                   in_nvme: bool, present: bool, where: str) -> None:
    m = meta(state=state, nvme=nvme, nvme_ready=ready)
    assert (m.in_cpu, m.in_nvme, m.present, m.where) == (in_cpu, in_nvme, present, where)


def test_cpu_pinned() -> None:
    m = meta(state=SlotState.READY)
    assert not m.cpu_pinned
    m.readers = 1
    assert m.cpu_pinned
    m.readers = 0
    m.nvme_busy = True
    assert m.cpu_pinned
    m.nvme_busy = False
    for s in (SlotState.NONE, SlotState.WRITING, SlotState.LOADING):
        assert meta(state=s).cpu_pinned


def test_leading_present_stops_at_the_first_gap() -> None:
    index = BlockIndex()
    metas = [meta(0, SlotState.READY), meta(1, nvme=SLOT, nvme_ready=True),
             meta(2, SlotState.LOADING), meta(3, SlotState.WRITING), meta(4, SlotState.READY)]
    for m in metas:
        index[m.key] = m
    keys = [m.key for m in metas]
    assert index.leading_present(keys) == 3
    assert index.leading_present(keys[:2]) == 2
    assert index.leading_present([]) == 0
    assert index.leading_present([b"\xff" * 16, *keys]) == 0
    assert index.leading_present(keys[4:]) == 1
