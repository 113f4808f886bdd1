"""The worker's loads and saves as they reach the daemon, and its link's leases, without a
daemon (a link to nowhere, or a client that records what it is asked): a failed load's
errors, a chain piece's parent, a lease of a replaced connection. Each was found unpinned
by a mutation review: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm import link as link_mod
from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import DaemonLink
from kvtier.connectors.vllm.metadata import TransferSpec
from kvtier.connectors.vllm.transfers import LoadBatch, SaveRequest

from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.vllm_fakes import fake as NS

TPB = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=TPB)


def _link() -> DaemonLink:
    return DaemonLink(ConnectorConfig(Path("/nonexistent.sock"), TPB, "m", timeout_s=1), LAYOUT)


def test_a_failed_load_reports_only_the_pages_it_was_to_fill() -> None:
    """A load whose first block's leading page vLLM computed itself (a local hit ending
    mid-block) fails: the pages it was to fill are the load errors, never that local page
    (a prefix-cache page other requests share and read: named invalid, it was marked bad
    for all of them, their saves stopped and each sharer rolled back to recompute it)."""
    link = _link()
    try:
        spec = TransferSpec("A", None, np.arange(1, 2 * TPB + 1, dtype=np.uint32), 0,
                            [[5, 6], [7, 8]], skip_pages=1)
        batch = LoadBatch([spec], NS(pages_per_block=2), lambda: link, 0, False)
        batch.open()                                  # the daemon is unreachable
        assert batch.close() == {6, 7, 8}
    finally:
        link.close()


def test_a_save_of_a_chain_s_later_blocks_names_their_parent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A save of blocks 2..3 of a request's chain is a piece of a longer chain: its put
    names block 1 as the parent (and starts at depth 2), so that the daemon keeps the
    chain whole (a parent outlives its children; orphan collection and recovery walk
    parents). Stored as a chain head it outlived its prefix: unreachable, never freed."""
    link = _link()
    asked: list[dict[str, Any]] = []

    class _Client:
        def prepare_put(self, ns: Any, keys: Any, **kw: Any) -> Any:
            asked.append({"keys": list(keys), **kw})
            return None

    monkeypatch.setattr(DaemonLink, "call", lambda self, op, default: op(_Client()))
    try:
        tokens = np.arange(1, 4 * TPB + 1, dtype=np.uint32)
        spec = TransferSpec("A", None, tokens, 2, [[1], [2]], save_id=0)
        assert not SaveRequest(spec, NS(block_bytes=1), lambda: link, 0).prepare()
        chain = block_keys(link.namespace(None, 0), tokens)
        assert asked == [{"keys": chain[2:4], "parent": chain[1], "start_depth": 2}]
    finally:
        link.close()


class _Client:
    """A connection: usable until closed, then every use raises what a closed socket does."""

    def __init__(self) -> None:
        self.closed = False

    def use(self) -> str:
        if self.closed:
            raise OSError(9, "Bad file descriptor")
        return "ok"

    def close(self) -> None:
        self.closed = True


def test_a_lease_of_a_closed_connection_is_not_ended_on_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's lease was opened on a connection the link has since replaced (it broke and
    was closed, its leases with it). Ending that lease fails without trying: tried, the
    closed socket's error read as "the connection broke at once" and closed the link's
    good new connection too, and with it every other save's and load's lease in flight."""
    clients: list[_Client] = []

    def connect(*_: Any, **__: Any) -> _Client:
        clients.append(_Client())
        return clients[-1]

    monkeypatch.setattr(link_mod, "_connect", connect)
    link = DaemonLink(ConnectorConfig(Path("/nonexistent.sock"), 16, "m", timeout_s=1),
                      LAYOUT)
    try:
        old = link._ensure()
        link.close()                                     # the daemon restarted: replaced
        assert link.call(lambda c: c.use(), None) == "ok"
        new = clients[-1]
        assert new is not old
        assert link.run(lambda _c: old.use(), old) == (False, None)
        assert link._client is new and not new.closed
    finally:
        link.close()
