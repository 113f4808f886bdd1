"""Saves the scheduler side handed to the workers and not yet acknowledged by all of them.

A lookup whose next block is in such a save answers "not yet" rather than miss it (the
blocks land within milliseconds), for ``PENDING_SAVE_WAIT_S`` at most; workers acknowledge
saves in their per-step metadata, and a save never acknowledged (a worker restarted) is
forgotten after ten times that.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

PENDING_SAVE_WAIT_S = 2.0
"""A lookup waits at most this long for a save of its next block to land."""
MAX_PRUNED = 65536


@dataclass(slots=True)
class PendingSave:
    """A save handed to the workers and not yet acknowledged by all of them."""

    salt: str | None
    token_ids: np.ndarray
    first_block: int
    end_block: int
    issued: float
    acks: int = 0


class PendingSaves:
    """The saves in flight, by save id, as the scheduler side planned them."""

    def __init__(self, tp_size: int, tokens_per_block: int) -> None:
        self.tp_size = tp_size
        self.tokens_per_block = tokens_per_block
        self._saves: dict[int, PendingSave] = {}
        self._next_id = 0
        self._pruned: set[int] = set()   # forgotten unacknowledged: maybe still running

    def add(self, salt: str | None, token_ids: np.ndarray, first_block: int,
            end_block: int) -> int:
        """Remember a save of blocks ``[first_block, end_block)``; its save id."""
        save_id = self._next_id
        self._next_id += 1
        self._saves[save_id] = PendingSave(salt, token_ids, first_block, end_block,
                                           time.monotonic())
        return save_id

    def acked(self, saves_done: Mapping[int, int]) -> None:
        """Workers done with these saves (committed or dropped): over once all are."""
        for save_id, n in saves_done.items():
            pending = self._saves.get(save_id)
            if pending is None:
                continue
            pending.acks += n
            if pending.acks >= self.tp_size:
                del self._saves[save_id]

    def prune(self, now: float) -> None:
        """Forget saves never acknowledged (a worker restarted)."""
        stale = [k for k, p in self._saves.items()
                 if now - p.issued > 10 * PENDING_SAVE_WAIT_S]
        for k in stale:
            del self._saves[k]
        if len(self._pruned) > MAX_PRUNED:   # (a worker restarted: its saves are gone)
            self._pruned.clear()
        self._pruned.update(stale)

    def over(self, save_ids: list[int]) -> bool:
        """Whether every worker acknowledged these saves (none is reading pages now)."""
        return not any(i in self._saves or i in self._pruned or i >= self._next_id
                       for i in save_ids)

    def holds(self, salt: str | None, tokens: Any, block: int) -> bool:
        """Whether a save not yet acknowledged holds block ``block`` of this token chain."""
        if not self._saves:
            return False
        end = (block + 1) * self.tokens_per_block
        if len(tokens) < end:
            return False
        now = time.monotonic()
        mine: np.ndarray | None = None
        for p in self._saves.values():
            if p.salt != salt or not p.first_block <= block < p.end_block:
                continue
            if now - p.issued > PENDING_SAVE_WAIT_S:
                continue
            if mine is None:
                mine = np.asarray(tokens[:end], dtype=np.uint32)
            if np.array_equal(p.token_ids[:end], mine):
                return True
        return False
