"""Several GET pipelines read at once by one thread: each connection is polled and read
without blocking, each value received straight into the buffer its placer gives.

Why one thread and not one per pipeline: a Redis server writes at most 64 KiB to a client
per turn of its event loop, so a read needs several connections to be fast; but a worker
thread per connection costs a GIL handoff and a wake-up per receive. On a 2-core machine,
32 GETs of 256 KiB over 8 connections took 2.6 ms and 1.2 ms of CPU here against 3.3 ms and
1.4 ms with 8 threads; inside the tier the threads' CPU per read was more than twice the
data copy, most of it futex waits and wake-ups (perf). Only plain sockets are read so (a TLS
socket can hold decrypted bytes that ``poll`` does not see); TLS reads keep one worker
thread per pipeline (kvtier.tiers.redis_reads).

A job is one pipeline to one server. Jobs start in order, at most ``width`` at a time, each
on its own pooled connection, as long as ``launch(job)`` agrees (a read that met a miss
starts nothing past it); a connection whose job is done goes on with the next job when
that is for the same server (a read keeps the connections it holds while it has work for
them), unless it received more than its job's replies (then the pool discards it). A
read's first pipeline always gets a connection, so a concurrent read is never shut out;
the others only while the server's pool has some to spare (``NodePool.limit``,
``redis.max_connections``), so concurrent reads share a bounded number of connections. A
connection that fails or passes its deadline fails its job and is discarded; every other
job goes on.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import CRLF, ErrorReply, NodeAddr, Placer, ProtocolError, command
from kvtier.tiers.redis_wire import Conn

# A value body with at least this much still due is received a chunk at a time, the
# reader woken once the chunk (or the whole rest, when less) has arrived
# (``Conn.wake_at``); below it, as it comes. Whole rests saved as much CPU but cost up to
# 9% of wall time on redis 6.2: chunks keep the copy overlapping the transfer.
LOWAT_MIN_BYTES = 128 << 10
LOWAT_CHUNK_BYTES = 1 << 20

# What a stream of large values receives at most into the read buffer at a time: the
# CRLF ending a value, the next reply's line and its head (a frame header) with room to
# spare. 32 x 256 KiB read from 7.0: through the read buffer the first 64 KiB of each body
# was copied once more (0.35 ms of Python per read).
FILL_CAP = 256
LARGE_VALUE_BYTES = 64 << 10

# Called with (index in the job, reply) as each reply is complete: the value's length
# (its bytes are where the placer said), None for a missing key, or an error reply; and
# once with the exception that failed the job at the first reply it did not get.
Done = Callable[[int, "int | ErrorReply | BaseException | None"], None]


@dataclass(slots=True, eq=False)
class GetJob:
    """One pipeline of GETs to one server (``head``: the bytes handed to ``place``)."""

    node: NodeAddr
    rkeys: Sequence[bytes]
    head: int
    place: Placer
    done: Done
    first: int = 0          # its place in the read's order (for ``launch``)
    # Values this large or more are expected: receive a reply's line, header and the
    # CRLF after it on their own (FILL_CAP bytes at most), so that a body goes from the
    # socket straight into its buffer instead of through the read buffer and a copy.
    large: bool = False
    # A value the placer refuses that is longer than this is not drained (None: any is):
    # the connection is closed mid-value, and the job's later replies are None (misses)
    # (found by review: 500 MiB planted behind a sound header were drained until the
    # deadline, so the read timed out, the value was never deleted, and concurrent
    # readers took the tier down).
    most: int | None = None
    error: BaseException | None = field(default=None, init=False)   # what failed it
    # its placer met a reply that cannot be this job's (another key's value): the
    # connection is dropped once the job is read, never reused (``Conn.stray_frame``)
    out_of_step: bool = field(default=False, init=False)
    started: bool = field(default=False, init=False)


class _Phase(Enum):
    LINE = 1      # waiting for a reply line
    HEAD = 2      # the value's first bytes, for the placer
    BODY = 3      # the rest, straight into the placed buffer
    SKIP = 4      # the rest, discarded (no place for it)
    TAIL = 5      # the CRLF after a value


class _Stream:
    """One job read over one connection, a step at a time (never blocks)."""

    __slots__ = ("cap", "conn", "dest", "head", "i", "job", "left", "n", "phase", "pos",
                 "tail")

    def __init__(self, conn: Conn, job: GetJob) -> None:
        self.conn = conn
        self.head = memoryview(bytearray(job.head))
        self.tail = memoryview(bytearray(2))
        self.dest: memoryview | None = None
        self.n = 0
        self.left = 0
        self.reset(job)

    def reset(self, job: GetJob) -> None:
        """Read ``job`` next (its pipeline was just sent on this connection)."""
        self.job = job
        self.i = 0
        self.phase = _Phase.LINE
        self.pos = 0
        if self.head.nbytes != job.head:
            self.head = memoryview(bytearray(job.head))
        self.cap = max(FILL_CAP, job.head + 64) if job.large else 0

    def step(self) -> bool:
        """Read what has arrived; True once every reply of the job is in."""
        conn = self.conn
        while True:
            phase = self.phase
            if phase is _Phase.BODY:
                dest = self.dest
                assert dest is not None
                while self.pos < dest.nbytes:
                    got = conn.recv_nowait(dest[self.pos:])
                    if not got:   # wake for the next chunk of a large value at once
                        due = dest.nbytes - self.pos
                        conn.wake_at(min(due, LOWAT_CHUNK_BYTES) if due >= LOWAT_MIN_BYTES
                                     else 1)
                        return False
                    self.pos += got
                conn.wake_at(1)
                self.dest, self.phase, self.pos = None, _Phase.TAIL, 0
            elif phase is _Phase.LINE:
                line = conn.take_line()
                if line is None:
                    if not conn.fill_nowait(self.cap):
                        return False
                    continue
                if self._line(line):
                    return True
            elif phase is _Phase.HEAD:
                if not self._fill(self.head):
                    return False
                if self._placed():
                    return True
            elif phase is _Phase.TAIL:
                if not self._fill(self.tail):
                    return False
                if self.tail != CRLF:
                    raise ProtocolError(f"bulk value from redis {conn.addr} not followed "
                                        "by CRLF")
                if self._reply(self.n):
                    return True
            else:   # SKIP
                while self.left:
                    if not conn.buffered() and not conn.fill_nowait():
                        return False
                    self.left -= conn.drop(self.left)
                self.phase = _Phase.TAIL

    def _fill(self, buf: memoryview) -> bool:
        """Fill a small buffer through the read buffer; whether it is full."""
        conn = self.conn
        while True:
            self.pos = conn.take_into(buf, self.pos)
            if self.pos == buf.nbytes:
                self.pos = 0
                return True
            if not conn.fill_nowait(self.cap):
                return False

    def _line(self, line: bytes) -> bool:
        kind = line[:1]
        if kind == b"-":
            return self._reply(ErrorReply(line[1:].decode(errors="replace")))
        if kind != b"$":
            raise ProtocolError(f"expected a bulk reply from redis {self.conn.addr}, "
                                f"got {kind!r}")
        n = self.conn.nil_or_length(line[1:])
        if n is None:
            return self._reply(None)
        self.n = n
        if self.head.nbytes != min(self.job.head, n):
            self.head = memoryview(bytearray(min(self.job.head, n)))
        self.phase, self.pos = _Phase.HEAD, 0
        return False

    def _placed(self) -> bool:
        """The value's head is in: ask where the rest goes. True when the job ends here: a
        refused value longer than ``job.most`` is reported (its length) without reading
        it on, the job's later replies as None, and the connection marked ``mid_reply``
        (closed by its pool, never reused)."""
        rest = self.n - self.head.nbytes
        dest = self.job.place(self.i, bytes(self.head), self.n)
        if dest is None:
            most = self.job.most
            if most is not None and self.n > most:
                self.conn.mid_reply = True
                finished = self._reply(self.n)
                while not finished:
                    finished = self._reply(None)
                return True
            self.left, self.phase = rest, _Phase.SKIP
            return False
        if dest.nbytes != rest:
            raise ValueError(f"placer gave {dest.nbytes} bytes for a {rest}-byte value")
        self.dest, self.phase, self.pos = dest, _Phase.BODY, 0
        return False

    def _reply(self, reply: int | ErrorReply | None) -> bool:
        self.job.done(self.i, reply)
        self.i += 1
        self.phase = _Phase.LINE
        if self.head.nbytes != self.job.head:
            self.head = memoryview(bytearray(self.job.head))
        return self.i == len(self.job.rkeys)


def read_jobs(jobs: Sequence[GetJob], pool_of: Callable[[NodeAddr], NodePool], width: int,
              launch: Callable[[GetJob], bool]) -> None:
    """Run ``jobs`` (blocking, in one thread), at most ``width`` connections at once, and
    beyond the first only as the server's pool allows (``NodePool.try_take``: concurrent
    reads share ``limit`` connections per server). A job that failed has ``error`` set
    (its connection discarded, the error reported as the reply it did not get, nothing
    after it); one that ``launch`` turned away has ``started`` False."""
    poller = select.poll()
    active: dict[int, _Stream] = {}
    pending = list(reversed(jobs))

    def fail(stream: _Stream, exc: BaseException) -> None:
        _failed(stream.job, stream.i, exc)
        fd = stream.conn.fileno()
        poller.unregister(fd)
        del active[fd]
        pool_of(stream.job.node).discard(stream.conn)

    try:
        while True:
            while pending and len(active) < width:
                job = pending[-1]
                if not launch(job):
                    pending.pop()
                    continue
                pool = pool_of(job.node)
                try:   # the first pipeline always gets a connection; more only within limit
                    conn = pool.try_take() if active else pool.take()
                except Exception as exc:   # could not connect: the job's failure
                    pending.pop()
                    job.started = True
                    _failed(job, 0, exc)
                    continue
                if conn is None:
                    break   # the server's connections are in use: go on with those held
                pending.pop()
                job.started = True
                stream = _start(job, pool, conn)
                if stream is not None:
                    fd = conn.fileno()
                    active[fd] = stream
                    poller.register(fd, select.POLLIN)
            if not active:
                if pending:
                    continue
                return
            now = time.monotonic()
            for stream in [s for s in active.values() if s.conn.deadline <= now]:
                fail(stream, stream.conn.timed_out())
            if not active:
                continue
            wait_ms = max(1, int((min(s.conn.deadline for s in active.values()) - now) * 1e3))
            for fd, _events in poller.poll(wait_ms):
                stream = active[fd]
                try:
                    finished = stream.step()
                except Exception as exc:   # the job's failure, reported with it
                    fail(stream, exc)
                    continue
                if finished:
                    # bytes past the job's replies, or a reply that was not this job's (a
                    # server out of step): the connection goes back to the pool, which
                    # discards it, never on to the next job
                    used = stream.conn
                    if stream.job.out_of_step:
                        used.stray_frame = True
                    nxt = (None if used.buffered() or used.out_of_step or used.stray_frame
                           or used.mid_reply else _next_job(stream.job.node, pending, launch))
                    if nxt is not None:   # sent on the same connection: keep polling it
                        stream.reset(nxt)
                        try:
                            _send(nxt, stream.conn)
                        except Exception as exc:   # the new job's failure, at its first reply
                            fail(stream, exc)
                        continue
                    poller.unregister(fd)
                    del active[fd]
                    pool_of(stream.job.node).give(stream.conn)
    finally:   # only an unexpected exit leaves streams: their connections are mid-reply
        for stream in active.values():
            pool_of(stream.job.node).discard(stream.conn)


def _next_job(node: NodeAddr, pending: list[GetJob],
              launch: Callable[[GetJob], bool]) -> GetJob | None:
    """The next job to start, when it is for ``node``: a stream whose job is done sends it
    on its own connection (no hand-back to the pool and taking again, no new stream)."""
    while pending and pending[-1].node == node:
        job = pending.pop()
        if launch(job):
            job.started = True
            return job
    return None


def _send(job: GetJob, conn: Conn) -> None:
    conn.begin()
    conn.send([command(b"GET", k) for k in job.rkeys])


def _start(job: GetJob, pool: NodePool, conn: Conn) -> _Stream | None:
    """Send the job's pipeline on ``conn``; None (the job failed, ``conn`` discarded) when
    that fails."""
    try:
        _send(job, conn)
    except Exception as exc:   # the job's failure, reported with it
        pool.discard(conn)
        _failed(job, 0, exc)
        return None
    return _Stream(conn, job)


def _failed(job: GetJob, at: int, exc: BaseException) -> None:
    job.error = exc
    job.done(at, exc)
