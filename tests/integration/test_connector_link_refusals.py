"""What the connector's daemon link does after the daemon refuses a call (real daemon): a
refusal it answered over a connection that stands keeps the connection and is logged once
per 10 s, not per call; a connection-level refusal (the daemon answers "id 0" and closes,
e.g. a frame over its limits) drops the connection (found by review)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.link import DaemonLink

from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess

LAYOUT = KVLayout(2, 2, 32, "float16", tokens_per_block=16)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("kvd"), cpu_bytes="16MiB", nvme_bytes="0") as d:
        yield d


def test_a_repeated_refusal_keeps_the_connection_and_is_logged_once(
        daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    # (a model id over the daemon's limit: ConnectorConfig.from_extra refuses it at start,
    # built directly here to get a refusal on every call)
    link = DaemonLink(ConnectorConfig(daemon.socket, 16, "m" * 1100, timeout_s=2), LAYOUT)
    ns = link.namespace(None, 0)
    with caplog.at_level(logging.WARNING, "kvtier.connectors.vllm"):
        for _ in range(30):
            assert link.lookup(ns, [b"k" * 16]) == 0
    assert link.connected and link.errors == 30
    assert caplog.text.count("daemon refused a request") == 1
    link.close()


def test_a_connection_level_refusal_drops_the_connection(daemon: DaemonProcess) -> None:
    link = DaemonLink(ConnectorConfig(daemon.socket, 16, "m", timeout_s=2), LAYOUT)
    ns = link.namespace(None, 0)
    assert link.lookup(ns, [b"k" * 16]) == 0 and link.connected
    # a frame of more items than any request may hold: answered with id 0, then closed
    got = link.call(lambda c: c._call({"op": "stats", "pad": list(range(5000))}), "default")
    assert got == "default"
    assert not link.connected
    link.close()
