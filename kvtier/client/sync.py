"""The blocking client: drives the sans-I/O ops (kvtier.client.ops) over a Unix socket."""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from kvtier.client import forks
from kvtier.client.hello import map_arena
from kvtier.client.leases import GetLease, PutLease
from kvtier.client.ops import (
    HANGUP,
    MAX_REPLY,
    LookupResult,
    NoWait,
    Op,
    Ops,
    Settle,
)
from kvtier.client.replies import SMALL_REQUEST, ReplyBound, decode_reply
from kvtier.config import default_socket_path, trusted_daemon_uids
from kvtier.errors import (
    ClientForked,
    DaemonUnavailable,
    KVTierError,
    ProtocolError,
    RequestTimeout,
)
from kvtier.handshake import Hello, handshake, open_verified
from kvtier.keys import BlockKey, Namespace
from kvtier.layout import KVLayout
from kvtier.prefix import PrefixLocality
from kvtier.protocol import LENGTH, pack

DEADLINE_SLACK = 0.01
"""A call may overrun its timeout by this share of it (1%): the socket's own timeout is
reset only when it is off by more, so a call answered at once costs no system call."""


class KVTierClient:
    """Blocking client. One per thread; cheap to create. ``device``: see ``connect``."""

    def __init__(self, sock: socket.socket, timeout: float, *, device: bool = False,
                 hello: Hello | None = None) -> None:
        """``hello``: the handshake ``connect`` already did on ``sock``; without it the
        daemon is verified and greeted here (trusted uids from the environment). ``timeout``
        bounds each call as a whole, its sends and receives on ``sock`` included (a socket
        the caller connected too: its own timeout is set to what a call has left)."""
        sock.settimeout(timeout)
        self._sock = sock
        self._timeout = timeout
        self._sock_timeout = timeout   # what ``sock`` waits now per send or receive
        self._slack = timeout * DEADLINE_SLACK
        self._ids = itertools.count(2)
        self._ops = Ops(device)
        self._broken: KVTierError | None = None
        self._poll = select.poll()     # the connection's state: readable, or hung up
        self._poll.register(sock, select.POLLIN | HANGUP)
        self._unanswered = 0   # replies still due to requests sent NoWait
        self._pid = forks.track(self)   # a forked child must connect again
        self._busy = threading.Lock()   # held by the one thread talking on the socket
        path = str(sock.getpeername())
        if hello is None:
            hello = handshake(sock, path, trusted_daemon_uids(), timeout)
            sock.settimeout(timeout)   # (the hello left it at the time it had left)
        map_arena(self._ops, hello, path)

    # transport
    def _until(self, deadline: float) -> None:
        """Let the socket's next wait end by ``deadline`` (``time.monotonic()``), within
        ``DEADLINE_SLACK`` of the timeout; TimeoutError once it passed. The socket's
        timeout bounds each wait, not a call: a daemon trickling a byte per almost-timeout
        held a 1 s call for 21 s (found by review). Set only when it is off by more than
        the slack, so a call whose reply comes at once makes no extra system call."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if abs(left - self._sock_timeout) > self._slack:
            self._sock.settimeout(left)
            self._sock_timeout = left

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            self._until(deadline)
            chunk = self._sock.recv(min(n - got, 1 << 20))
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _forked(self) -> None:
        """In a forked child (kvtier.client.forks): every later call raises."""
        self._broken = forks.forked_error(self._pid)

    def _unusable(self) -> DaemonUnavailable:
        assert self._broken is not None
        if isinstance(self._broken, ClientForked):
            return self._broken
        return DaemonUnavailable(f"connection unusable after an earlier failure: "
                                 f"{self._broken}")

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """Hold the socket for one exchange (two threads at once: ProtocolError)."""
        if not self._busy.acquire(blocking=False):
            raise _shared_between_threads()
        try:
            yield
        finally:
            self._busy.release()

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._alone():
            return self._call_alone(req)

    def _recv_reply(self, deadline: float, bound: ReplyBound) -> dict[str, Any]:
        """The next reply frame, whole by ``deadline``, decoded within ``bound``."""
        (n,) = LENGTH.unpack(self._recv_exact(LENGTH.size, deadline))
        if n > MAX_REPLY:
            raise ProtocolError(f"reply of {n} bytes is too large")
        return decode_reply(self._recv_exact(n, deadline), bound)

    def _call_alone(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._broken is not None:
            raise self._unusable()
        rid = next(self._ids)
        req["id"] = rid
        deadline = time.monotonic() + self._timeout   # for the whole call, skips included
        bound = ReplyBound.of(req)   # (a skipped NoWait reply is small: within it too)
        try:
            self._until(deadline)
            self._sock.sendall(pack(req))
            while True:
                reply = self._recv_reply(deadline, bound)
                got = reply.get("id")
                if type(got) is int and got in (rid, 0):
                    break
                if not self._unanswered:   # no NoWait reply was due: out of step
                    raise ProtocolError(f"daemon answered request {got!r:.20} while "
                                        f"request {rid} was due")
                self._unanswered -= 1   # a NoWait's, skipped
                if time.monotonic() > deadline:
                    raise TimeoutError
        except (OSError, ProtocolError) as exc:
            self._lost(exc, str(req.get("op")))
        try:
            return Ops.check_reply(reply)
        except KVTierError as exc:
            if reply.get("id") == 0:   # about the connection, which the daemon now closes:
                exc.reported = False   # not a refusal a caller may go on after (review)
            raise

    def _lost(self, exc: OSError | ProtocolError, what: str) -> NoReturn:
        """``_fail`` with the typed error of a transport failure during ``what``."""
        if isinstance(exc, TimeoutError):
            self._fail(RequestTimeout(f"no reply to {what} within {self._timeout}s"))
        if isinstance(exc, ProtocolError):
            self._fail(exc)
        self._fail(DaemonUnavailable(f"daemon connection lost: {exc}"))

    def _fail(self, exc: KVTierError) -> NoReturn:
        """The connection is out of step (a reply is late, or not the one due): raise
        ``exc``, now and on every later call. It stays open until ``close``: the caller
        may still be writing into a put lease's views, which a hang-up would give back."""
        self._broken = exc
        raise exc from None

    def _settle(self) -> dict[str, Any]:
        """Read the replies still owed to requests sent NoWait (``Settle``), within the
        timeout; an error the daemon sent to whoever asks (id 0) raises here."""
        if self._broken is not None:
            raise self._unusable()
        with self._alone():
            deadline = time.monotonic() + self._timeout
            try:
                while self._unanswered:
                    reply = self._recv_reply(deadline, SMALL_REQUEST)   # releases, reports
                    if reply.get("id") == 0:
                        return Ops.check_reply(reply)
                    self._unanswered -= 1
            except (OSError, ProtocolError) as exc:
                self._lost(exc, "earlier requests sent without waiting")
        return {}

    def _events(self) -> int:
        """The connection's poll events now (0: nothing to read, not hung up)."""
        got = self._poll.poll(0)   # (one descriptor registered)
        return got[0][1] if got else 0

    def _send_nowait(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send ``req`` without waiting for its reply (the next call skips it); a
        connection already broken or hung up asks as ``_call`` does, and fails the same."""
        if self._broken is not None or self._events() & HANGUP:
            return self._call(req)
        with self._alone():
            req["id"] = next(self._ids)
            try:
                self._until(time.monotonic() + self._timeout)
                self._sock.sendall(pack(req))
            except OSError as exc:
                self._lost(exc, str(req.get("op")))
            self._unanswered += 1
        return {}

    def _run(self, op: Op) -> Any:
        """Drive ``op`` to its result: each request it yields is sent and its reply sent
        back in; a request's typed error is thrown into the op, which may handle it (see
        ``Ops._ask``, ``quietly``) or let it propagate."""
        try:
            req = next(op)
            while True:
                try:
                    if isinstance(req, NoWait):
                        reply = self._send_nowait(req.req)
                    elif isinstance(req, Settle):
                        reply = self._settle()
                    else:
                        reply = self._call(req)
                except KVTierError as exc:
                    req = op.throw(exc)
                else:
                    req = op.send(reply)
        except StopIteration as stop:
            return stop.value

    # API
    def register_layout(self, layout: KVLayout, model_id: str, *, tp_rank: int = 0,
                        tp_size: int = 1, cache_salt: str | None = None) -> Namespace:
        """Tell the daemon about a layout; returns the Namespace to key blocks with."""
        return self._run(self._ops.op_register(layout, model_id, tp_rank, tp_size, cache_salt))

    def lookup(self, ns: Namespace, keys: Sequence[BlockKey], *,
               prefetch: bool = True) -> LookupResult:
        """Leading keys present in any tier; starts promoting lower-tier hits."""
        return self._run(self._ops.op_lookup(ns, keys, prefetch))

    def prepare_put(self, ns: Namespace, keys: Sequence[BlockKey], *,
                    parent: BlockKey | None = None, start_depth: int = 0) -> PutLease:
        """Write-locked slots for ``keys``, a piece of a prefix chain (``parent`` is the key
        before ``keys[0]``, ``start_depth`` its position; defaults: a whole prompt)."""
        return PutLease(self, *self._run(self._ops.op_prepare_put(ns, keys, parent,
                                                                  start_depth)))

    def prepare_get(self, ns: Namespace, keys: Sequence[BlockKey], *,
                    prefer_device: bool | None = None) -> GetLease:
        """Read-locked views of the leading available blocks (see ``GetLease``).

        ``prefer_device`` (default: the client's ``device``): when the daemon has an HBM
        pool, place the blocks there and hand out device views where it could.
        """
        return GetLease(self, *self._run(self._ops.op_prepare_get(ns, keys, prefer_device)))

    def leading_bound(self, keys: Sequence[BlockKey]) -> int | None:
        """An upper bound on what ``lookup(keys)`` would find now, read from the daemon's
        presence filter without a round trip (kvtier.presence); None when the daemon passed
        no exact filter or this connection is no longer open (ask the daemon then)."""
        view = self._ops.presence
        if view is None or not view.exact or self._broken is not None:
            return None
        events = self._events()
        if events & HANGUP or (events & select.POLLIN and not self._unanswered):
            return None   # hung up, or readable with nothing asked (the daemon wrote out of
            #               turn): the next call finds out which
        return view.leading_bound(keys)

    @property
    def hbm_info(self) -> dict[str, Any] | None:
        """The daemon's HBM pool from the handshake (handle, size, device, pci_bus_id), or
        None when it has none."""
        return self._ops.hbm_info

    @property
    def put_bytes(self) -> int:
        """The most arena bytes this process may hold in open puts, as the daemon announced
        it (0: not announced). A put of more is capped to its leading blocks."""
        return self._ops.put_bytes

    @property
    def hbm_mapped(self) -> bool:
        """Whether this client has mapped the daemon's HBM pool (after a device get)."""
        return self._ops.hbm is not None

    def put(self, ns: Namespace, keys: Sequence[BlockKey], buffers: Sequence[Any], *,
            durable: bool = False, output_tokens: int | None = None) -> int:
        """Store blocks (one memcpy each into the arena); returns how many were stored.
        ``LeaseExpired`` when a batch's commit came past the TTL (see ``Ops.op_put``)."""
        return self._run(self._ops.op_put(ns, keys, buffers, durable, output_tokens))

    def get(self, ns: Namespace, keys: Sequence[BlockKey], out_buffers: Sequence[Any]) -> int:
        """Copy the leading available blocks into host ``out_buffers``; returns how many.
        Always reads through cpu views (``prefer_device=False``).

        Raises ``LeaseExpired`` when the copy outlived the lease TTL (a stalled client): the
        bytes may belong to another block, so nothing is returned as valid and the contents
        of ``out_buffers`` are unspecified. Retry, or treat it as a miss."""
        return self._run(self._ops.op_get(ns, keys, out_buffers))

    def delete(self, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        """Remove the blocks from every tier; how many went (blocks under another read
        lease are skipped; this client's own finished gets are settled first)."""
        return self._run(self._ops.op_delete(ns, keys))

    def prefix_locality(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, *,
                        redis: bool = True) -> PrefixLocality:
        """How many leading tokens of a prompt this daemon's node holds (by tier) and the
        shared Redis holds: a read-only probe for routing (nothing is promoted or
        registered). ``hit_blocks`` equals what ``lookup`` would find now."""
        return self._run(self._ops.op_prefix(ns, [token_ids], redis, False))[0]

    def prefix_locality_batch(self, ns: Namespace,
                              prompts: Sequence[Sequence[int] | np.ndarray], *,
                              redis: bool = True) -> list[PrefixLocality]:
        """``prefix_locality`` for several prompts in one round trip."""
        return self._run(self._ops.op_prefix(ns, prompts, redis, True))

    def stats(self) -> dict[str, Any]:
        return self._run(self._ops.op_stats())

    def report_engine(self, *, engine_id: str | None = None, **values: float) -> None:
        """Connector-side gauges (running, waiting, context_tokens_p50/p99) and counters
        (cumulative since the engine started; ``engine_id``, fixed for the engine's life,
        lets the daemon count them once across reconnects)."""
        self._run(self._ops.op_report(values, engine_id))

    def report_engine_nowait(self, *, engine_id: str | None = None,
                             **values: float) -> None:
        """``report_engine`` without waiting for its reply (the next call skips it, as it
        skips any reply that is not its own): an engine reports from inside its step."""
        if self._broken is not None:
            raise self._unusable()
        (req,) = self._ops.op_report(values, engine_id)
        assert isinstance(req, dict)
        self._send_nowait(req)

    def ping(self) -> None:
        self._call({"op": "ping"})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        self._ops.close()

    def __enter__(self) -> KVTierClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def _shared_between_threads() -> ProtocolError:
    return ProtocolError("a KVTierClient was called from two threads at once: it is not "
                         "thread-safe; use one client per thread (they are cheap)")


def connect(socket_path: str | Path | None = None, timeout: float = 5.0, *,
            device: bool = False, trusted_uids: Collection[int] | None = None,
            hello_timeout: float | None = None) -> KVTierClient:
    """Connect to the node's daemon; DaemonUnavailable when none answers.

    The daemon must run as this process's uid or one of ``trusted_uids`` (default: the
    uids in ``KVTIER_TRUSTED_UIDS``), checked with SO_PEERCRED before anything is sent
    (UntrustedDaemon otherwise); its arena is mapped only if it is a private file of that
    uid (UntrustedArena otherwise). See docs/client-api.md, "Trust".

    ``device=True`` (GPU engines): gets prefer device placement, so on a daemon with an HBM
    pool they may hand out device views (the pool is mapped at the first such get).

    ``hello_timeout``: a shorter bound for the connect and hello alone (a caller retrying
    a daemon that may be stalled need not wait ``timeout`` for each try); requests then
    use ``timeout``.
    """
    path = str(socket_path or default_socket_path())
    trusted = trusted_daemon_uids() if trusted_uids is None else frozenset(trusted_uids)
    sock, hello = open_verified(path, timeout if hello_timeout is None else hello_timeout,
                                trusted)
    sock.settimeout(timeout)
    try:
        return KVTierClient(sock, timeout, device=device, hello=hello)
    except BaseException:
        sock.close()
        raise
