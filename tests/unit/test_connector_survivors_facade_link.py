"""The connector's ``DaemonLink`` with a client that answers by hand and a clock of the
test's own (no daemon): a lease whose get expired is not good KV, a lease whose body
failed is ended, a connection that broke at once is replaced and the call tried once
more, a failed connect backs off doubling up to its bound and a working one resets it.
Each was found unpinned by a mutation review of the connector: a test fails on its
mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm import link as link_mod
from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import RECONNECT_HELLO_S, DaemonLink

from kvtier.errors import DaemonUnavailable, LeaseExpired
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=16)
KEY = b"k" * 16


class Lease:
    """A lease's context manager: records how it was ended; ``fail`` raised at exit."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.exits: list[type[BaseException] | None] = []

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        self.exits.append(kind)
        if self.fail is not None:
            raise self.fail


class Client:
    """A client whose ``use`` raises what ``raises`` holds next (then answers "ok")."""

    def __init__(self, raises: list[BaseException]) -> None:
        self.raises = raises
        self.used = 0
        self.closed = False

    def use(self) -> str:
        self.used += 1
        if self.raises:
            raise self.raises.pop(0)
        return "ok"

    def close(self) -> None:
        self.closed = True


class World:
    """``_connect`` stood in: each connection a ``Client`` sharing ``raises``; connecting
    fails while ``down``. Records the hello timeout each connect was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.raises: list[BaseException] = []
        self.clients: list[Client] = []
        self.hellos: list[float | None] = []
        self.down = False
        self.now = 100.0
        monkeypatch.setattr(link_mod, "_connect", self.connect)

    def connect(self, socket_path: str, timeout: float, device: bool = False,
                hello_timeout: float | None = None) -> Client:
        self.hellos.append(hello_timeout)
        if self.down:
            raise DaemonUnavailable("no daemon")
        self.clients.append(Client(self.raises))
        return self.clients[-1]

    def link(self, **config: Any) -> DaemonLink:
        cfg = ConnectorConfig(Path("/nonexistent.sock"), 16, "m", timeout_s=2, **config)
        return DaemonLink(cfg, LAYOUT, clock=lambda: self.now)


def test_a_get_lease_that_expired_raises_to_the_loader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes read under an expired get lease may be another block's: the loader must
    see ``LeaseExpired`` (and recompute), never a lease that ended quietly."""
    world = World(monkeypatch)
    link = world.link()
    lease = Lease(fail=LeaseExpired("ttl"))
    with pytest.raises(LeaseExpired), link.lease(lambda c: lease) as got:
        assert got is lease
    assert lease.exits == [None] and link.errors == 1
    assert link.connected                         # the connection itself stands


def test_a_lease_whose_body_failed_is_ended_with_its_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that raised still ends its lease (the client aborts or releases it): a
    lease left open pins its slots in the daemon until its TTL."""
    world = World(monkeypatch)
    link = world.link()
    lease = Lease(fail=RuntimeError("exit failed too"))
    with pytest.raises(ValueError, match="copy"), link.lease(lambda c: lease):
        raise ValueError("copy failed")
    assert lease.exits == [ValueError]


def test_a_lease_that_could_not_be_ended_drops_the_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease end that timed out leaves the connection suspect: it is dropped (and the
    link backs off), not kept for the next step's calls."""
    world = World(monkeypatch)
    link = world.link()
    with link.lease(lambda c: Lease(fail=EOFError("closed"))):
        pass
    assert not link.connected and world.clients[0].closed and link.errors == 1
    assert link.call(lambda c: c.use(), "default") == "default"   # backing off
    assert len(world.clients) == 1


def test_a_connection_that_broke_at_once_is_replaced_and_the_call_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon restarted: the old connection's first call fails at once; the call is
    tried again on a fresh connection, with no backoff, and answers."""
    world = World(monkeypatch)
    link = world.link()
    assert link.call(lambda c: c.use(), None) == "ok"
    world.raises.append(EOFError("daemon restarted"))
    assert link.call(lambda c: c.use(), None) == "ok"
    assert len(world.clients) == 2 and world.clients[0].closed
    assert link.connected and link.errors == 0


def test_a_fresh_connection_that_fails_is_not_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection made for this very call that fails at once is a daemon that is not
    there: dropped and backed off, not retried on yet another connection."""
    world = World(monkeypatch)
    link = world.link()
    world.raises.append(EOFError("gone"))
    assert link.call(lambda c: c.use(), "default") == "default"
    assert len(world.clients) == 1 and link.errors == 1 and not link.connected


def test_reconnects_back_off_doubling_up_to_the_bound_and_reset_once_connected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Failed connects wait ``reconnect_min_s``, then twice as long each time up to
    ``reconnect_max_s``; a link that connected again starts from the minimum after its
    next outage. A retry's hello is short (a stalled daemon holds the step that long)."""
    world = World(monkeypatch)
    link = world.link(reconnect_min_s=1.0, reconnect_max_s=4.0)
    world.down = True
    waits = []
    for _ in range(4):
        assert link.call(lambda c: c.use(), None) is None
        waits.append(link._retry_at - world.now)
        assert link.call(lambda c: c.use(), None) is None      # not tried before then
        world.now = link._retry_at
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert world.hellos == [None] + [min(2, RECONNECT_HELLO_S)] * 3
    world.down = False
    assert link.call(lambda c: c.use(), None) == "ok"
    world.down = True
    link.close()
    assert link.call(lambda c: c.use(), None) is None
    assert link._retry_at - world.now == 1.0
    assert world.hellos[-1] is None                    # the first try after it worked


def test_an_empty_lookup_asks_the_daemon_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No keys, no round trip (and no connection): a 0 or None straight away."""
    world = World(monkeypatch)
    link = world.link()
    ns = link.namespace(None, 0)
    assert link.lookup(ns, []) == 0 and link.lookup_result(ns, []) is None
    assert world.hellos == []
    link.preconnect()
    assert link.leading_bound([]) is None


def test_preconnect_runs_the_connect_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection made ahead of the first request gets the same set-up (the worker maps
    its device pool there) as one made by a call."""
    world = World(monkeypatch)
    link = world.link()
    seen: list[Any] = []
    link.on_connect = seen.append
    assert link.preconnect() is True and seen == world.clients
    world.down = True
    link.close()
    assert link.preconnect() is False and link._retry_at == 0.0   # quiet: no backoff


def test_errors_count_every_failure_the_link_absorbed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``errors`` feeds the engine's failure counter: a dropped connection and a lease
    end that failed on a lost connection each count once."""
    world = World(monkeypatch)
    link = world.link()
    client = link._ensure()
    world.raises.append(EOFError("lost"))
    assert link.run(lambda c: c.use(), client) == (False, None)
    assert link.errors == 1 and not link.connected
    world.raises.append(TimeoutError("slow"))       # an OSError: the connection is lost
    assert link.call(lambda c: c.use(), None) is None
    assert link.errors == 2


def test_a_lease_end_the_client_fumbled_drops_the_connection_not_vllm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other exception ending a lease (a malformed reply's KeyError) is a failed
    client: the connection is dropped and the step goes on; raised, it took vLLM down."""
    world = World(monkeypatch)
    link = world.link()
    with link.lease(lambda c: Lease(fail=KeyError("slot"))):
        pass
    assert not link.connected and link.errors == 1
