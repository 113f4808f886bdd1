"""The Redis tier's link to Redis: its state, worker threads, routing, health and reconnects.

``RedisLink`` is the base of ``RedisTier`` (kvtier.tiers.redis, which states the contract):
it holds the tier's state and everything about reaching the servers: running blocking RESP
exchanges in worker threads, one call per server holding some keys (``_per_server``),
counting failures (a connection failure or ``DOWN_AFTER_FAILURES`` soft ones in a row mark
the tier down; in a cluster the failed server leaves the routing), the idle health check
(PING, and INFO/DBSIZE every ``STATS_EVERY`` rounds) and the reconnect loop with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier import codec as codecs
from kvtier.backoff import Backoff, BackoffPolicy
from kvtier.config import RedisConfig
from kvtier.frame import Codec
from kvtier.layout import KVLayout
from kvtier.tiers import redis_loopio as loopio
from kvtier.tiers.base import TierCounters
from kvtier.tiers.redis_client import RedisMode, parse_target
from kvtier.tiers.redis_info import ServerStats
from kvtier.tiers.redis_queue import DEFAULT_ELEM_BYTES, WriteOutcomes, WriteQueue
from kvtier.tiers.redis_resp import (
    KEY_ERRORS,
    REDIRECTS,
    ErrorReply,
    NodeAddr,
    ReplyError,
    command,
)
from kvtier.tiers.redis_route import Reach, Router, conn_options
from kvtier.tiers.redis_wire import LARGE_REPLY_BYTES, Conn

log = logging.getLogger("kvtier.tiers.redis")   # one logger for the whole Redis tier

DOWN_AFTER_FAILURES = 3           # soft failures (timeouts, error replies) in a row
RECONNECT_BACKOFF = BackoffPolicy(base_s=0.05, cap_s=5.0)   # kvtier.backoff: x2, jitter 0.5
HEALTH_INTERVAL_S = 1.0           # PING while idle, so `up` falls even without traffic
STATS_EVERY = 5                   # health rounds between INFO/DBSIZE refreshes
MONITOR_BACKOFF = BackoffPolicy(base_s=HEALTH_INTERVAL_S, cap_s=5.0)   # after a failed round
CLUSTER_REDIRECTS = (*REDIRECTS, "CLUSTERDOWN", "TRYAGAIN")  # replies that mean "re-route"
# a cluster node that cannot serve a key now (loading its data, a replica that answers for
# a master, a replica that lost its master, busy with a script): re-route, as for a
# redirect; its slots miss until the slot map heals, the other nodes' keys do not
CLUSTER_UNAVAILABLE = ("LOADING", "READONLY", "MASTERDOWN", "BUSY")
# a write refused for what the server holds (at its maxmemory, no key it may evict): that
# write is dropped and counted; the server still serves reads and the tier stays up
WRITE_REFUSALS = ("OOM",)

T = TypeVar("T")
UNSERVED = object()               # per-key result: no live server for the key's slot


class RedisLink:
    """The Redis tier's state and its connection to the servers (base of ``RedisTier``)."""

    def __init__(self, cfg: RedisConfig, *,
                 elem_bytes_hint: int = DEFAULT_ELEM_BYTES) -> None:
        self.cfg = cfg
        self.counters = TierCounters()
        self._target = parse_target(cfg)
        seed, opts = conn_options(cfg, self._target)
        self._cluster = self._target.mode is RedisMode.CLUSTER
        self._router = Router(seed, opts, cluster=self._cluster,
                              pool_size=max(1, cfg.max_connections),
                              seeds=[NodeAddr(h, p) for h, p in self._target.seeds])
        self._exec = ThreadPoolExecutor(max_workers=max(2, cfg.max_connections),
                                        thread_name_prefix="kvtier-redis")
        choice = codecs.from_config(cfg.codec)
        self._codec: Codec | codecs.AutoCodec = codecs.AutoCodec() if choice is None else choice
        self._elem_bytes = elem_bytes_hint     # fallback: no layout known for a namespace
        self._layout_of: Callable[[bytes], KVLayout | None] | None = None
        self._prefix = cfg.key_prefix.encode()
        self._ttl = cfg.ttl_s if cfg.ttl_s > 0 else None
        self._queue = WriteQueue(cfg.write_queue_blocks, cfg.write_queue_copy_bytes)
        self._outcomes = WriteOutcomes()       # per key: is its newest write in Redis
        self._inflight = asyncio.Semaphore(max(1, cfg.write_inflight))   # SET batches
        self._writing = 0                      # SET batches in flight
        self._sending: dict[bytes, int] = {}   # Redis key -> its writes in those batches
        self._wake = asyncio.Event()           # queue non-empty, or the tier came up
        self._progress = asyncio.Event()       # a batch finished or `up` changed
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writer: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._reconnector: asyncio.Task[None] | None = None
        self._closed = False
        self._up = False
        self._consecutive_failures = 0
        self._watch_refused = False   # said once (note_refused_watch)
        self.reconnects = 0
        self.last_error = ""
        self._unserved_since: float | None = None
        self.last_heal_s = 0.0                 # last time from a failed server to healed
        self._frames_raw = 0                   # raw bytes of frames written (codec ratio)
        self._frames_wire = 0
        self._server = ServerStats()           # the masters' INFO and DBSIZE
        self.namespace_mismatches = 0          # frames found under another namespace
        self.redirects = 0                     # keys asked again where MOVED/ASK said
        self._learning: asyncio.Future[None] | None = None   # CLUSTER NODES in flight

    def use_layouts(self, layout_of: Callable[[bytes], KVLayout | None]) -> None:
        """Where block layouts come from (the store's namespace registry, ``layout``): each
        queued block is shuffled with its namespace's element width (4 for fp32), not the
        ``elem_bytes_hint`` fallback."""
        self._layout_of = layout_of

    def _elem_bytes_for(self, namespace: bytes) -> int:
        """The element width of ``namespace``'s layout, or the fallback when unknown."""
        layout = self._layout_of(namespace) if self._layout_of is not None else None
        return layout.element_bytes if layout is not None else self._elem_bytes

    def _block_bytes_for(self, namespace: bytes) -> int | None:
        """The block size of ``namespace``'s layout, or None when unknown."""
        layout = self._layout_of(namespace) if self._layout_of is not None else None
        return layout.block_bytes if layout is not None else None

    def _rkey(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _window(self, batch_bytes: int) -> int:
        """GET pipelines of ``batch_bytes`` in flight at once: ``max_inflight``, and about
        ``inflight_bytes_per_server`` per live master (at least two each). A Redis server
        executes commands on one thread and copies each GET pipeline's whole reply into
        its output buffers: beyond the bytes that keep it busy, more pipelines add no
        throughput, only buffered bytes there and busy worker threads here (bench_redis,
        through the daemon: 8 GETs of 3 MiB took 9-10 ms with 2 in flight against one
        server, 12-18 ms with 8; 32 GETs of 256 KiB, one per pipeline read by one thread,
        1.9 ms with 8 in flight, 2.0 ms with 16, 3.3 ms with 32).
        SETs are not windowed so: their replies are "+OK", and their median times did
        not improve (7-9 ms vs 6.5-7.7 ms for 8 x 3 MiB)."""
        live = sum(1 for m in self._router.masters() if m not in self._router.failed)
        per_server = max(2, self.cfg.inflight_bytes_per_server // max(1, batch_bytes))
        return max(1, min(self.cfg.max_inflight, per_server * max(1, live)))

    async def _in_thread(self, fn: Callable[[], T], *, holds_buffers: bool = False) -> T:
        """Run blocking ``fn`` in the tier's worker threads. When ``fn`` uses the caller's
        buffers (``holds_buffers``) and the caller is cancelled, wait for ``fn`` to end
        first (bounded by op_timeout_s); otherwise a cancelled caller returns at once (a
        lookup budget cuts a probe) and the thread ends on its own."""
        fut = asyncio.get_running_loop().run_in_executor(self._exec, fn)
        if not holds_buffers:
            return await fut
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)
            raise

    async def _per_server(self, rkeys: Sequence[bytes],
                          fn: Callable[[Conn, list[int]], Sequence[Any]], *,
                          holds_buffers: bool = False,
                          small: Callable[[list[int]], list[bytes]] | None = None
                          ) -> list[Any]:
        """Run ``fn(conn, indexes)`` once per server holding some of ``rkeys`` (in parallel,
        in worker threads); returns one result per key: ``fn``'s, the exception that failed
        its server (already counted), or UNSERVED. ``small(indexes)``: the same exchange as
        encoded commands with simple replies (a probe), run on the event loop instead when
        the server has an idle plain connection (kvtier.tiers.redis_loopio)."""
        results: list[Any] = [UNSERVED] * len(rkeys)

        async def one(node: NodeAddr | None, idx: list[int]) -> None:
            if node is None:
                return
            pool = self._router.pool(node)
            conn = pool.take_idle() if small is not None else None
            if conn is not None and not conn.plain:
                pool.give(conn)
                conn = None
            try:
                if conn is not None and small is not None:
                    replies = await loopio.exchange_taken(pool, conn, small, idx)
                else:
                    replies = await self._in_thread(lambda: pool.run(lambda c: fn(c, idx)),
                                                    holds_buffers=holds_buffers)
            except Exception as exc:
                self._failed(exc, node)
                for i in idx:
                    results[i] = exc
                return
            for i, reply in zip(idx, replies, strict=True):
                results[i] = reply

        groups = self._router.group(rkeys)
        await asyncio.gather(*(one(node, idx) for node, idx in groups.items()))
        if self._cluster:
            await self._follow_redirects(results, fn, holds_buffers)
        return results

    async def _follow_redirects(self, results: list[Any],
                                fn: Callable[[Conn, list[int]], Sequence[Any]],
                                holds_buffers: bool) -> None:
        """Ask once more, at the server named, for each key whose result is a MOVED or ASK
        redirect to a known cluster member (an ASK behind an ASKING: its slot is being
        migrated and only this exchange goes there); its result is replaced by that
        answer. A MOVED also reloads the slot map (in the background); a server not known
        yet has the members listed again first (CLUSTER NODES, one round trip). Results are
        replies, or values carrying one in ``error`` (a block read's)."""
        redirects: dict[int, ErrorReply] = {}
        for i, result in enumerate(results):
            reply = result if isinstance(result, ErrorReply) else getattr(result, "error", None)
            if isinstance(reply, ErrorReply) and reply.kind in REDIRECTS:
                redirects[i] = reply
        if not redirects:
            return
        if any(r.kind == "MOVED" for r in redirects.values()):
            self._start_reconnect()
        targets = {i: self._router.redirect(r) for i, r in redirects.items()}
        if None in targets.values():
            # a server the tier has not met: a master just added to the cluster (one
            # CLUSTER NODES for every exchange that meets it at once)
            if self._learning is None or self._learning.done():
                self._learning = asyncio.ensure_future(
                    self._in_thread(self._router.learn_members))
            try:
                await asyncio.shield(self._learning)
            except Exception as exc:   # (it catches connection errors itself)
                self._note_error(exc)
            targets.update({i: self._router.redirect(redirects[i])
                            for i, hop in targets.items() if hop is None})
        hops: dict[tuple[NodeAddr, bool], list[int]] = {}
        for i, hop in targets.items():
            if hop is not None:
                hops.setdefault(hop, []).append(i)

        async def follow(node: NodeAddr, asking: bool, idx: list[int]) -> None:
            def run(conn: Conn) -> Sequence[Any]:
                conn.asking = asking
                answer = fn(conn, idx)
                conn.asking = False   # (a failed exchange discards the connection)
                return answer

            pool = self._router.pool(node)
            try:
                replies = await self._in_thread(lambda: pool.run(run),
                                                holds_buffers=holds_buffers)
            except Exception as exc:   # the redirect's own results stand
                self._failed(exc, node)
                return
            self.redirects += len(idx)
            for i, reply in zip(idx, replies, strict=True):
                results[i] = reply

        await asyncio.gather(*(follow(node, asking, idx)
                               for (node, asking), idx in hops.items()))

    async def _monitor_loop(self) -> None:
        """Health rounds every HEALTH_INTERVAL_S while up, for as long as the tier runs: a
        round that raises (a bug, a reply nothing checked) is logged and counted, and the
        next one waits longer (MONITOR_BACKOFF) instead of the monitor ending; a
        monitor that ended would leave the tier up while its server hangs."""
        rounds = 0
        backoff = Backoff(MONITOR_BACKOFF)
        delay = HEALTH_INTERVAL_S
        while True:
            await asyncio.sleep(delay)
            delay = HEALTH_INTERVAL_S
            if not self._up:
                continue
            try:
                await self._health(rounds % STATS_EVERY == 0)
            except Exception as exc:
                self._note_error(exc)
                delay = max(HEALTH_INTERVAL_S, backoff.next_delay())
                if backoff.attempts == 1:   # once per run of failing rounds
                    log.exception("redis tier: health check failed; retrying in %.1f s",
                                  delay)
            else:
                backoff.reset()
            rounds += 1

    async def _health(self, refresh_stats: bool) -> None:
        """PING every live master (INFO memory and DBSIZE too when ``refresh_stats``)."""
        cmds = [command(b"PING")]
        if refresh_stats:
            cmds += [command(b"INFO", b"memory"), command(b"DBSIZE")]
        masters = [m for m in self._router.masters() if m not in self._router.failed]

        async def ask(node: NodeAddr) -> list[Any] | None:
            pool = self._router.pool(node)
            try:
                return await self._in_thread(lambda: pool.run(
                    lambda c: c.simple_many(cmds, LARGE_REPLY_BYTES)))
            except Exception as exc:
                self._failed(exc, node)
                return None

        answers = await asyncio.gather(*(ask(m) for m in masters))
        good = [a for a in answers if a is not None]
        for answer in good:
            if isinstance(answer[0], ErrorReply):
                self._error_reply(answer[0])
                return
        if len(good) == len(answers):
            self._succeeded()
        if refresh_stats and good and len(good) == len(answers):
            self._server.take(good)

    def _start_reconnect(self) -> None:
        if self._closed or (self._reconnector and not self._reconnector.done()):
            return
        self._reconnector = asyncio.create_task(self._reconnect_loop(),
                                                name="kvtier-redis-reconnect")

    async def _reconnect_loop(self) -> None:
        """Reload routing with backoff until every slot has a live server (the one server
        answers PING, or a cluster's failed masters were replaced or came back)."""
        backoff = Backoff(RECONNECT_BACKOFF)
        while not self._closed:
            await asyncio.sleep(backoff.next_delay())
            try:
                reach = await self._in_thread(self._router.refresh)
            except Exception as exc:
                self.last_error = _describe(exc)
                continue
            if reach is Reach.UNREACHABLE:
                self.last_error = self._router.last_error or self.last_error
                if self._up:
                    self._mark_down()
                continue
            if not self._up:
                self.reconnects += 1
                self._set_up()
                log.info("redis tier reconnected: %s", self._target.display)
            if reach is Reach.HEALED:
                if self._unserved_since is not None:
                    self.last_heal_s = time.monotonic() - self._unserved_since
                    self._unserved_since = None
                    log.info("redis tier: every slot served again after %.2f s",
                             self.last_heal_s)
                return

    def _set_up(self) -> None:
        self._up = True
        self._consecutive_failures = 0
        self._wake.set()
        self._progress.set()

    def _mark_down(self) -> None:
        self._up = False
        self._progress.set()
        self.counters.dropped_writes += self._queue.drop_borrowed()
        self._outcomes.give_up_waiting()   # what is still queued waits for the tier
        self._router.drop_pools()
        log.warning("redis tier down (%s): %s", self._target.display, self.last_error)
        self._start_reconnect()

    def _succeeded(self) -> None:
        self._consecutive_failures = 0

    def _note_error(self, exc: BaseException) -> None:
        self.counters.errors += 1
        self.last_error = _describe(exc)

    def _error_reply(self, reply: ErrorReply) -> None:
        """An error reply: in a cluster a redirect or an unavailable node means "reload the
        slot map"; a key's or a write's own trouble is counted only."""
        if self._cluster and reply.kind in (*CLUSTER_REDIRECTS, *CLUSTER_UNAVAILABLE):
            self._note_error(ReplyError(str(reply)))
            self._unserved_since = self._unserved_since or time.monotonic()
            self._start_reconnect()
            return
        if reply.kind in KEY_ERRORS or reply.kind in WRITE_REFUSALS:
            self._note_error(ReplyError(str(reply)))   # not the server's failure
            return
        self._failed(ReplyError(str(reply)))

    def note_refused_watch(self, reply: ErrorReply) -> None:
        """The server refused WATCH (``redis_stripes``: an ACL without +watch +multi +exec
        +unwatch): counted, and said once, since blocks that lost a stripe then stay."""
        self._note_error(ReplyError(str(reply)))
        if not self._watch_refused:
            self._watch_refused = True
            log.warning("redis tier: the server refused WATCH (%s); a block that lost a "
                        "stripe stays in Redis until rewritten, evicted or expired: add "
                        "+watch +multi +exec +unwatch to kvtier's ACL (docs/redis.md)", reply)

    def _failed(self, exc: BaseException, node: NodeAddr | None = None) -> None:
        """Count a failure. One server: down on a connection failure or a run of them.
        Cluster: the failed server leaves the routing and the slot map is reloaded."""
        self._note_error(exc)
        if self._cluster and node is not None:
            if node not in self._router.failed:
                log.warning("redis tier: server %s failed (%s); its slots miss until "
                            "the slot map heals", node, self.last_error)
            self._router.mark_failed(node)
            self._unserved_since = self._unserved_since or time.monotonic()
            self._start_reconnect()
            return
        self._consecutive_failures += 1
        hard = isinstance(exc, OSError) and not isinstance(exc, TimeoutError)
        if self._up and (hard or self._consecutive_failures >= DOWN_AFTER_FAILURES):
            self._mark_down()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
