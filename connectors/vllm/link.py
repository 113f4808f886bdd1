"""DaemonLink: a kvtier client that never takes vLLM down with it.

vLLM must keep serving when the daemon is absent, restarting or wedged. The link connects
lazily, turns every failure into "no hit / nothing stored", logs one warning per outage
(not one per step), and reconnects with exponential backoff. Every daemon call is bounded
by the client's timeout, so a step never waits longer than ``timeout_s`` per call, and not
at all while the link is backing off.

A ``kvtier.client`` client is not thread-safe: each thread that talks to the daemon owns
its own link.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, TypeVar

from kvtier.errors import (
    DaemonUnavailable,
    KVTierError,
    LeaseExpired,
    ProtocolError,
    RequestTimeout,
)
from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.lograte import LogRate

from .config import ConnectorConfig

logger = logging.getLogger("kvtier.connectors.vllm")
_warn = LogRate(logger)   # refusals: one line per 10 s per link (a per-request error)

T = TypeVar("T")
# What ``_run`` returns: ``(True, op's result)`` or ``(False, None)`` after a failure.
_Outcome = tuple[Literal[True], T] | tuple[Literal[False], None]

# Errors after which the connection itself is suspect: drop it and reconnect later.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    DaemonUnavailable, RequestTimeout, ProtocolError, OSError, EOFError,
)
# ... and with the daemon's refusals, what one try of a call may end with (``_answered``)
_FAILURES: tuple[type[BaseException], ...] = (*_CONNECTION_ERRORS, KVTierError)
# Of those, the ones a fresh connection may cure at once (the daemon restarted).
_RETRYABLE: tuple[type[BaseException], ...] = (DaemonUnavailable, OSError, EOFError)
# What connecting may raise: anything (unreachable, a refused or malformed handshake).
# Any exception from the client is a daemon failure: a malformed reply's KeyError or a
# hello's ValueError used to escape into vLLM (found by review).
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (Exception,)


def _answered(exc: BaseException) -> TypeGuard[KVTierError]:
    """A refusal the daemon answered (a ``KVTierError`` it reported, ProtocolError
    included): its connection stands, so it is not dropped (one request's bad input, a
    tenant's salt over the daemon's limit, took every other request's saves down with the
    connection for a backoff; found by review). Anything else of ``_CONNECTION_ERRORS``
    (a timeout, a malformed reply, a closed socket) makes the connection suspect."""
    if isinstance(exc, KVTierError) and exc.reported:
        return True
    return not isinstance(exc, _CONNECTION_ERRORS) and isinstance(exc, KVTierError)


RECONNECT_HELLO_S = 0.25   # a live daemon greets in milliseconds, even a busy one


def _connect(socket_path: str, timeout: float, device: bool = False,
             hello_timeout: float | None = None) -> Any:
    """Open a client (indirection so the import happens only when a daemon is wanted)."""
    from kvtier.client import connect

    return connect(socket_path=socket_path, timeout=timeout, device=device,
                   hello_timeout=hello_timeout)


@dataclass(slots=True)
class DaemonLink:
    """One resilient connection to the node daemon, with namespaces registered on it.

    ``layout``, ``tp_size`` and ``model_id`` are fixed per engine; namespaces differ by
    (cache_salt, KV shard) and are computed locally, so keys never need the daemon. Ranks
    that hold identical KV (``replicas`` consecutive ones, as vLLM's ``KVCacheConfig``
    says: every rank for an MLA latent) share one namespace, keyed by the shard they hold,
    so an engine of another TP size holding the same shard per rank shares its blocks.
    """

    config: ConnectorConfig
    layout: KVLayout
    tp_size: int = 1
    replicas: int = 1          # (a divisor of tp_size: geometry.tp_replicas)
    name: str = "connector"
    clock: Callable[[], float] = time.monotonic
    device: bool = False
    on_connect: Callable[[Any], None] | None = None
    _client: Any = field(default=None, init=False)
    _retry_at: float = field(default=0.0, init=False)
    _backoff: float = field(default=0.0, init=False)
    _down_since: float | None = field(default=None, init=False)
    errors: int = field(default=0, init=False)

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def shards(self) -> int:
        """How many different KV shards the ranks hold (one namespace each)."""
        return self.tp_size // self.replicas

    def namespace(self, cache_salt: str | None, tp_rank: int) -> Namespace:
        """The namespace of (salt, the shard ``tp_rank`` holds); computed locally, so keys
        work without a daemon."""
        return Namespace(self.config.model_id, self.layout, tp_rank // self.replicas,
                         self.shards, cache_salt)

    def call(self, op: Callable[[Any], T], default: T) -> T:
        """Run ``op(client)``; ``default`` on any failure (the client registers a
        namespace with the daemon on its first use on a connection)."""
        outcome = self._run(op)
        return outcome[1] if outcome[0] else default

    @contextlib.contextmanager
    def lease(self, opener: Callable[[Any], Any]) -> Iterator[Any]:
        """A put/get lease as a context manager, or ``None`` when the daemon is unusable.

        Errors raised by the daemon while opening or closing the lease drop the
        connection (or are logged), except ``LeaseExpired``, which propagates: what a get
        read may be wrong and must be recomputed; errors from the body propagate after the
        lease is aborted/released by the client's own context manager.
        """

        def open_lease(client: Any) -> tuple[Any, Any]:
            cm = opener(client)
            return cm, cm.__enter__()

        opened = self._run(open_lease)
        if not opened[0]:
            yield None
            return
        cm, lease = opened[1]
        try:
            yield lease
        except BaseException as exc:
            with contextlib.suppress(Exception):   # the body's exception is the one to see
                cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            cm.__exit__(None, None, None)
        except LeaseExpired:  # a get's bytes may be another block's: the caller recomputes
            self.errors += 1
            raise
        except _FAILURES as exc:
            if not _answered(exc):
                self._drop(exc)
                return
            self.errors += 1
            logger.warning("kvtier %s: lease not completed (%s: %s)", self.name, exc.code, exc)
        except Exception as exc:   # not a KVTierError: the client failed (found by review)
            self._drop(exc)

    def _run(self, op: Callable[[Any], T]) -> _Outcome[T]:
        """``(True, op(client))``, or ``(False, None)`` after a failure.

        A connection that worked before and now fails at once (broken pipe, reset: the
        daemon restarted) is replaced immediately and the call retried once; a timeout is
        not retried, so one call never waits more than twice ``timeout_s``.
        """
        for attempt in range(2):
            reused = self._client is not None
            client = self._ensure()
            if client is None:
                return False, None
            lost: list[BaseException] = []
            outcome = self._try(op, client, lost.append if attempt == 0 and reused
                                else self._drop)
            if not lost:
                return outcome
            self._reconnect(lost[0])
        return False, None

    def run(self, op: Callable[[Any], T], client: Any) -> tuple[bool, T | None]:
        """``(True, op(client))``, or ``(False, None)`` after a failure (logged, counted):
        for an op that ends a lease opened on ``client`` (release, commit, abort), whose
        caller must tell a failure from a default value.

        Tried once, on ``client`` only: a lease lives on the connection that opened it, so
        a fresh connection cannot end it (a retry there reported a lost get lease as
        released, or failed again and dropped the good new connection). A ``client`` the
        link no longer holds was closed, and its leases with it. A connection lost at once
        (the daemon restarted) is closed without a backoff: the next call reconnects.
        """
        if client is None or client is not self._client:
            self.errors += 1
            return False, None

        def lost(exc: BaseException) -> None:
            self.errors += 1
            self._reconnect(exc)

        return self._try(op, client, lost)

    def _try(self, op: Callable[[Any], T], client: Any,
             on_lost: Callable[[BaseException], None]) -> _Outcome[T]:
        """One try of ``op`` on ``client``; a connection lost at once goes to ``on_lost``,
        other connection failures back off (``_drop``), a refusal is logged."""
        try:
            return True, op(client)
        except _RETRYABLE as exc:
            on_lost(exc)
        except _FAILURES as exc:
            if not _answered(exc):
                self._drop(exc)
                return False, None
            self.errors += 1
            _warn.warning(f"refused-{self.name}", "kvtier %s: daemon refused a request "
                          "(%s: %s); continuing without it", self.name, exc.code, exc)
        except Exception as exc:   # any other: the client failed; vLLM goes on without it
            self._drop(exc)        # (a KeyError of a malformed reply escaped; found by review)
        return False, None

    def _reconnect(self, exc: BaseException) -> None:
        """The connection broke at once (the daemon restarted): close it, no backoff."""
        self.close()
        logger.info("kvtier %s: daemon connection lost (%s); reconnecting", self.name, exc)

    def preconnect(self) -> bool:
        """Try to connect now, quietly: a failure is neither logged nor backed off (the
        first real call reports it). Engines call it at start so that the first request
        does not pay for the connection and the arena mapping."""
        if self._client is not None:
            return True
        try:
            self._client = _connect(str(self.config.socket_path), self.config.timeout_s,
                                    self.device)
        except _CONNECT_ERRORS:
            return False
        if self.on_connect is not None:
            self.on_connect(self._client)
        return True

    def lookup_result(self, namespace: Namespace, keys: Sequence[BlockKey]) -> Any:
        """The daemon's ``LookupResult`` for ``keys`` (hits, tiers, bandwidth), or None
        when it is unreachable."""
        if not keys:
            return None
        return self.call(lambda c: c.lookup(namespace, list(keys)), None)

    def leading_bound(self, keys: Sequence[BlockKey]) -> int | None:
        """An upper bound on the lookup of ``keys`` from the daemon's presence filter, with
        no round trip (kvtier.presence); None when there is none to read (not connected,
        no exact filter, the connection closed): ask with ``lookup_result`` then."""
        client = self._client
        if client is None or not keys:
            return None
        return client.leading_bound(keys)

    def lookup(self, namespace: Namespace, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of ``keys`` the daemon holds (0 when it is unreachable)."""
        if not keys:
            return 0
        return int(self.call(lambda c: c.lookup(namespace, list(keys)).hits, 0))

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    # -- internals -------------------------------------------------------------------

    def _ensure(self) -> Any:
        if self._client is not None:
            return self._client
        now = self.clock()
        if now < self._retry_at:
            return None
        # a retry after a failure (the daemon may be stalled, not gone) holds the engine's
        # thread for a short hello at most, not a whole request timeout per try
        hello_s = (None if self._down_since is None
                   else min(self.config.timeout_s, RECONNECT_HELLO_S))
        try:
            self._client = _connect(str(self.config.socket_path), self.config.timeout_s,
                                    self.device, hello_s)
            if self.on_connect is not None:
                self.on_connect(self._client)
        except _CONNECT_ERRORS as exc:
            self._note_down(exc, now)
            return None
        if self._down_since is not None:
            logger.warning("kvtier %s: reconnected to the daemon at %s after %.1f s",
                           self.name, self.config.socket_path, now - self._down_since)
        self._down_since = None
        self._backoff = 0.0
        return self._client

    def _drop(self, exc: BaseException) -> None:
        self.errors += 1
        self.close()
        self._note_down(exc, self.clock())

    def _note_down(self, exc: BaseException, now: float) -> None:
        if self._down_since is None:
            self._down_since = now
            logger.warning("kvtier %s: daemon unavailable at %s (%s: %s); vLLM continues "
                           "without KV offload and reconnects in the background",
                           self.name, self.config.socket_path, type(exc).__name__, exc)
        self._backoff = min(self.config.reconnect_max_s,
                            max(self.config.reconnect_min_s, self._backoff * 2))
        self._retry_at = now + self._backoff
