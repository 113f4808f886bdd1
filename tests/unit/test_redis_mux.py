"""The polling GET reader (kvtier.tiers.redis_mux) against a scripted peer on a unix socket:
replies cut at every possible boundary land exactly where the placer says, and a peer that
breaks the protocol, hangs up mid-value or never answers fails only its own job, within
the deadline. (A real redis-server never splits its replies this finely; the reads against
one are in tests/integration/test_redis_mux.py.)"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import pytest

from kvtier.tiers.redis_mux import GetJob, read_jobs
from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import ConnOptions, ErrorReply, NodeAddr, ProtocolError
from tests.support.resp_peer import bulk, cuts, peer

HEAD = 8   # bytes of each value handed to the placer


class Reads:
    """Placer and completion callback of one job: where each value goes, what came back."""

    def __init__(self, sizes: list[int | None]) -> None:
        self.bufs = [None if n is None else memoryview(bytearray(n)) for n in sizes]
        self.heads: dict[int, bytes] = {}
        self.replies: list[tuple[int, object]] = []

    def place(self, i: int, head: bytes, n: int) -> memoryview | None:
        self.heads[i] = head
        buf = self.bufs[i]
        return None if buf is None else buf[:n - len(head)]

    def done(self, i: int, reply: object) -> None:
        self.replies.append((i, reply))


def read_all(addr: NodeAddr, jobs: list[GetJob], width: int = 4,
             timeout_s: float = 2.0) -> None:
    """``read_jobs`` of ``jobs`` over a fresh pool of connections to ``addr``."""
    pool = NodePool(addr, ConnOptions(connect_timeout_s=1.0, op_timeout_s=timeout_s), 2)
    try:
        read_jobs(jobs, lambda _a: pool, width, lambda _j: True)
    finally:
        pool.close()


def run(addr: NodeAddr, n_keys: int, reads: Reads, timeout_s: float = 2.0,
        large: bool = False) -> GetJob:
    job = GetJob(addr, [b"k%d" % i for i in range(n_keys)], HEAD, reads.place, reads.done,
                 large=large)
    read_all(addr, [job], timeout_s=timeout_s)
    return job


@pytest.mark.parametrize("large", [False, True])   # True: lines and heads received apart
@pytest.mark.parametrize("most", [1, 3, 97, 4096, 1 << 20])
def test_replies_cut_anywhere_land_exactly(tmp_path: Path, most: int, large: bool) -> None:
    rng = random.Random(most)
    error = b"-ERR wrong kind"      # (told apart by identity: a random value may start "-")
    values = [os.urandom(3000), None, error, os.urandom(5), b"", os.urandom(70_000),
              os.urandom(HEAD)]
    wire = b"".join(b"$-1\r\n" if v is None else v + b"\r\n" if v is error else bulk(v)
                    for v in values)

    def script(conn: socket.socket) -> None:
        for piece in cuts(wire, rng, most):
            conn.sendall(piece)

    # value 3 (5 bytes, shorter than HEAD) gets no buffer: the placer says "skip it"
    reads = Reads([3000 - HEAD, None, None, None, 0, 70_000 - HEAD, 0])
    with peer(tmp_path, script) as addr:
        job = run(addr, len(values), reads, large=large)
    assert job.error is None and job.started
    assert [i for i, _ in reads.replies] == list(range(len(values)))
    got = dict(reads.replies)
    assert got[1] is None
    assert isinstance(got[2], ErrorReply) and got[2].kind == "ERR"
    for i in (0, 3, 4, 5, 6):
        value = values[i]
        assert value is not None
        assert got[i] == len(value)
        assert reads.heads[i] == value[:HEAD]
        buf = reads.bufs[i]
        if buf is not None:
            assert bytes(buf) == value[HEAD:]


@pytest.mark.parametrize(("wire", "why"), [
    (bulk(b"x" * 20) + b"+OK\r\n", "a status reply where a bulk value belongs"),
    (b"$20\r\n" + b"x" * 20 + b"XY", "a value not followed by CRLF"),
])
def test_protocol_breach_fails_the_job(tmp_path: Path, wire: bytes, why: str) -> None:
    def script(conn: socket.socket) -> None:
        conn.sendall(wire)
        time.sleep(0.5)

    reads = Reads([20 - HEAD, 20 - HEAD])
    with peer(tmp_path, script) as addr:
        job = run(addr, 2, reads)
    assert isinstance(job.error, ProtocolError), why
    assert reads.replies[-1] == (len(reads.replies) - 1, job.error)


def test_hangup_mid_value_fails_at_that_value(tmp_path: Path) -> None:
    first = os.urandom(100)

    def script(conn: socket.socket) -> None:
        conn.sendall(bulk(first) + b"$5000\r\n" + b"y" * 1000)

    reads = Reads([100 - HEAD, 5000 - HEAD])
    with peer(tmp_path, script) as addr:
        job = run(addr, 2, reads)
    assert isinstance(job.error, ConnectionResetError)
    assert reads.replies[0] == (0, 100) and bytes(reads.bufs[0] or b"") == first[HEAD:]
    assert reads.replies[1] == (1, job.error)


def test_silent_peer_times_out_within_the_deadline(tmp_path: Path) -> None:
    def script(conn: socket.socket) -> None:
        conn.sendall(b"$40\r\n" + b"z" * 10)   # then nothing
        time.sleep(2.0)

    reads = Reads([40 - HEAD])
    with peer(tmp_path, script) as addr:
        t0 = time.monotonic()
        job = run(addr, 1, reads, timeout_s=0.3)
        took = time.monotonic() - t0
    assert isinstance(job.error, TimeoutError)
    assert 0.25 < took < 1.5
    assert reads.replies == [(0, job.error)]


def test_unreachable_server_fails_the_job_without_starting_it(tmp_path: Path) -> None:
    reads = Reads([10])
    job = run(NodeAddr(str(tmp_path / "nobody.sock"), 0, unix=True), 1, reads)
    assert isinstance(job.error, OSError) and job.started
    assert reads.replies == [(0, job.error)]


def _jobs(addr: NodeAddr, reads: list[Reads]) -> list[GetJob]:
    return [GetJob(addr, [b"k%d" % i], HEAD, r.place, r.done, i, large=True)
            for i, r in enumerate(reads)]


def test_a_servers_jobs_follow_each_other_on_one_connection(tmp_path: Path) -> None:
    """A stream whose job is done sends the next job for the same server on its own
    connection: one connection serves them all, each value lands in its own buffer."""
    values = [os.urandom(70_000 + i) for i in range(4)]
    accepted: list[int] = []

    def script(conn: socket.socket) -> None:
        accepted.append(1)
        conn.sendall(bulk(values[0]))
        for value in values[1:]:
            if not conn.recv(1 << 16):   # the next job's GET, on this same connection
                return
            conn.sendall(bulk(value))
        time.sleep(0.2)

    reads = [Reads([len(v) - HEAD]) for v in values]
    with peer(tmp_path, script) as addr:
        jobs = _jobs(addr, reads)
        read_all(addr, jobs, width=1)
    assert [j.error for j in jobs] == [None] * 4 and all(j.started for j in jobs)
    assert accepted == [1]
    for value, r in zip(values, reads, strict=True):
        assert r.replies == [(0, len(value))] and bytes(r.bufs[0] or b"") == value[HEAD:]


def test_a_connection_lost_between_jobs_fails_only_the_next_job(tmp_path: Path) -> None:
    first = os.urandom(70_000)

    def script(conn: socket.socket) -> None:
        conn.sendall(bulk(first))   # then hang up before the next job's reply

    reads = [Reads([70_000 - HEAD]), Reads([70_000 - HEAD])]
    with peer(tmp_path, script) as addr:
        jobs = _jobs(addr, reads)
        read_all(addr, jobs, width=1)
    assert jobs[0].error is None and reads[0].replies == [(0, 70_000)]
    assert bytes(reads[0].bufs[0] or b"") == first[HEAD:]
    assert isinstance(jobs[1].error, OSError) and reads[1].replies == [(0, jobs[1].error)]
