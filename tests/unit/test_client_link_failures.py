"""DaemonLink never takes vLLM down (found by review): any exception from the client, typed
or not (a malformed reply's KeyError, a hello's ValueError), is a daemon failure: logged
once, the call answers its default, the connection is dropped and retried later."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from kvtier.connectors.vllm import link as link_mod
from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import DaemonLink

from kvtier.errors import ProtocolError, RequestTimeout, error_from_code
from kvtier.layout import KVLayout
from tests.support.fake_daemon import HostileSocketDaemon

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=16)


class _Broken:
    """A client whose every call raises what a missed reply check would."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.closed = False

    def lookup(self, *_: Any) -> Any:
        raise self.exc

    def prepare_get(self, *_: Any) -> Any:
        raise self.exc

    def close(self) -> None:
        self.closed = True


def broken_link(monkeypatch: pytest.MonkeyPatch,
                exc: Exception) -> tuple[DaemonLink, list[_Broken]]:
    """A link whose every connection is a ``_Broken`` raising ``exc``; the clients made."""
    clients: list[_Broken] = []

    def connect(*_: Any, **__: Any) -> _Broken:
        clients.append(_Broken(exc))
        return clients[-1]

    monkeypatch.setattr(link_mod, "_connect", connect)
    return DaemonLink(ConnectorConfig(Path("/nonexistent.sock"), 16, "m", timeout_s=1),
                      LAYOUT), clients


@pytest.mark.parametrize("exc", [KeyError("stats"), TypeError("x"), ValueError("y"),
                                 IndexError("z"), RuntimeError("w")])
def test_an_untyped_client_error_is_a_daemon_failure(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture,
                                                     exc: Exception) -> None:
    link, clients = broken_link(monkeypatch, exc)
    ns = link.namespace(None, 0)
    with caplog.at_level(logging.WARNING, logger="kvtier.connectors.vllm"):
        assert link.lookup(ns, [b"k" * 16]) == 0
        assert link.lookup(ns, [b"k" * 16]) == 0   # backing off: no new connection
        with link.lease(lambda c: c.prepare_get(ns, [b"k" * 16])) as lease:
            assert lease is None
    assert len(clients) == 1 and clients[0].closed and not link.connected
    assert sum("unavailable" in r.message for r in caplog.records) == 1   # logged once


def test_a_malformed_hello_is_a_daemon_failure(tmp_path: Path) -> None:
    def hello(conn: socket.socket, req: dict[str, Any]) -> None:
        HostileSocketDaemon.send(conn, {"id": req["id"], "ok": True, "version": 1,
                                        "arena": {"path": "/dev/shm/x\x00y", "size": 4096}})

    with HostileSocketDaemon(tmp_path, LAYOUT.block_bytes, hello=hello) as d:
        link = DaemonLink(ConnectorConfig(d.path, 16, "m", timeout_s=2), LAYOUT)
        assert link.preconnect() is False
        assert link.lookup(link.namespace(None, 0), [b"k" * 16]) == 0
        link.close()


@pytest.mark.parametrize(("exc", "dropped"), [
    (error_from_code("protocol", "cache_salt is limited to 1024 characters"), False),
    (error_from_code("limit", "too many keys"), False),
    (ProtocolError("daemon sent overlapping slots"), True),      # raised here: suspect
    (RequestTimeout("no reply in 2 s"), True),
])
def test_a_refusal_the_daemon_answered_keeps_the_connection(
        monkeypatch: pytest.MonkeyPatch, exc: Exception, dropped: bool) -> None:
    """One request's input the daemon refused (a ProtocolError it answered, over a
    connection that stands) took the connection down with a backoff, and every other
    request's saves with it (found by review); an error raised on this side still drops."""
    link, clients = broken_link(monkeypatch, exc)
    ns = link.namespace(None, 0)
    assert link.lookup(ns, [b"k" * 16]) == 0
    assert link.connected is not dropped and clients[0].closed is dropped
    with link.lease(lambda c: c.prepare_get(ns, [b"k" * 16])) as lease:
        assert lease is None
    assert len(clients) == 1 and link.errors == 2 - dropped
