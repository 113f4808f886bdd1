"""The contract between a sans-I/O op and the client that drives it.

An ``Op`` yields requests and two directives beside them: ``NoWait`` (send, do not wait
for the reply) and ``Settle`` (wait for the replies still owed); ``HANGUP`` is the poll test
a driver makes before trusting a ``NoWait``. ``done`` and ``quietly`` are ops built from
nothing or from another op. The ops (kvtier.client.ops), the leases and both drivers
(kvtier.client.sync, kvtier.client.aio) build on this module; it imports none of them.
"""

from __future__ import annotations

import select
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from kvtier.errors import KVTierError


@dataclass(frozen=True, slots=True)
class NoWait:
    """A request whose reply nobody needs: the client sends it and sends the op ``{}`` at
    once, unless its connection is already broken or hung up, when it is asked as usual
    (and fails as usual). The reply, when it comes, is skipped like any reply not awaited."""

    req: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Settle:
    """Wait (within the client's timeout) for the replies still owed to requests sent
    ``NoWait``, then send the op ``{}``: once a release's reply came, the daemon has
    unpinned its blocks, so a request that must see that (``delete``) goes after it."""


SETTLE = Settle()
HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)
"""poll events of a connection whose daemon is gone (closed its end, or died): how a
client tells, before a ``NoWait``, that the daemon holding its lease is still the one."""
Op = Generator["dict[str, Any] | NoWait | Settle", dict[str, Any], Any]
"""A sans-I/O operation: yields requests, is sent replies (or thrown their errors), and
returns its result."""


def done(value: Any = None) -> Op:
    """An op that sends nothing and returns ``value`` (a lease that is already closed)."""
    return value
    yield  # pragma: no cover - makes this a generator


def quietly(op: Op) -> Op:
    """Run ``op`` and ignore a daemon error: cleanup after another failure, whose error is
    the one the caller must see."""
    try:
        return (yield from op)
    except KVTierError:
        return None
