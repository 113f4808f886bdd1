"""Saves the scheduler side handed to the workers (connectors/vllm/pending.py): over only
once every worker acknowledged them; one forgotten unacknowledged is never taken as over
(its worker may still read pages that vLLM would free)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.pending import PENDING_SAVE_WAIT_S, PendingSaves


def test_saves_are_over_once_every_worker_acknowledged_them() -> None:
    saves = PendingSaves(tp_size=2, tokens_per_block=4)
    tokens = np.arange(8, dtype=np.uint32)
    a, b = saves.add(None, tokens, 0, 1), saves.add(None, tokens, 1, 2)
    assert not saves.over([a]) and not saves.over([a + 100])   # never planned: not over
    saves.acked({a: 1})
    assert not saves.over([a])                                 # one of two workers
    saves.acked({a: 1, b: 2})
    assert saves.over([a, b]) and saves.over([])


def test_a_save_forgotten_unacknowledged_is_never_over() -> None:
    saves = PendingSaves(tp_size=1, tokens_per_block=4)
    s = saves.add(None, np.arange(4, dtype=np.uint32), 0, 1)
    saves.prune(time.monotonic() + 11 * PENDING_SAVE_WAIT_S)
    assert not saves.holds(None, np.arange(4, dtype=np.uint32), 0)   # forgotten
    assert not saves.over([s])
