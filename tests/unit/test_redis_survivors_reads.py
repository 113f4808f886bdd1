"""Reads of the Redis tier against a scripted RESP server (tests/support/resp_peer.py), at
edges the mutation review found unpinned: a reply out of step whose key, read again,
holds a sound frame of another size than the caller's buffer (layout unknown) is the
caller's mismatch, never a reason to delete the stored block."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from kvtier.frame import FrameHeader, payload_checksum
from kvtier.tiers.redis_mux import GetJob, read_jobs
from kvtier.tiers.redis_pool import NodePool
from kvtier.tiers.redis_resp import ConnOptions
from tests.support.redis_tier import LAYOUT_FP, NS, cfg_for, rkey, running
from tests.support.resp_peer import answering, bulk, peer


def frame(key: bytes, payload: bytes) -> bytes:
    return FrameHeader(NS, key, LAYOUT_FP, len(payload), len(payload),
                       payload_checksum(payload)).pack() + payload


def test_a_stray_reply_whose_key_holds_a_block_of_another_size_deletes_nothing(
        tmp_path: Path) -> None:
    """GET A, GET B answered A's frame twice (out of step). B's header, read again,
    is a sound frame of B whose raw_len is not the 4096-byte buffer, and the
    namespace's block size is unknown: the buffer, not the frame, may be wrong. A miss
    counted as the stray reply; B is not deleted."""
    a, b = b"A" * 16, b"B" * 16
    pa, pb = os.urandom(4096), os.urandom(8192)
    seen: list[list[bytes]] = []

    def answer(cmd: list[bytes]) -> bytes:
        seen.append(cmd)
        if cmd[0] == b"GET":
            return bulk(frame(a, pa))   # B's too: out of step
        if cmd[0] == b"GETRANGE":
            value = frame(a, pa) if cmd[1] == rkey(a) else frame(b, pb)
            return bulk(value[:int(cmd[3]) + 1])
        return b":1\r\n" if cmd[0] == b"DEL" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url, max_connections=1, max_inflight=1)) as tier:
            outs = [memoryview(bytearray(4096)) for _ in (a, b)]
            assert await tier.get_into([a, b], outs, namespace=NS, layout_fp=LAYOUT_FP) == 1
            assert bytes(outs[0]) == pa and bytes(outs[1]) == bytes(4096)
            assert tier.counters.checksum_failures == 0
            assert tier.counters.errors == 1 and "another key" in tier.last_error

    with peer(tmp_path, answering(answer), name="stray.sock", read_first=False,
              concurrent=True) as addr:
        asyncio.run(main(f"unix://{addr.host}"))
    assert [cmd for cmd in seen if cmd[0] == b"GETRANGE" and cmd[1] == rkey(b)]
    assert not any(cmd[0] == b"DEL" for cmd in seen)


def test_a_giant_value_refused_unread_is_no_protocol_error(tmp_path: Path) -> None:
    """A planted value far longer than any frame of its block, behind a sound header: the
    muxed reader refuses it unread and closes its connection as left mid-reply. Handed
    back as an ordinary connection instead, the pool finds the value's bytes buffered
    and blames the server for sending more than its replies (a protocol error counted
    and logged for a sound server)."""
    key = b"G" * 16
    head = FrameHeader(NS, key, LAYOUT_FP, 4096, 4096, 0).pack()

    def answer(cmd: list[bytes]) -> bytes:
        if cmd[0] == b"GET":
            return b"$%d\r\n" % (1 << 40) + head + os.urandom(4096)
        return b":1\r\n" if cmd[0] == b"DEL" else b"+PONG\r\n"

    async def main(url: str) -> None:
        async with running(cfg_for(url, op_timeout_s=2.0)) as tier:
            out = [memoryview(bytearray(4096))]
            assert await tier.get_into([key], out, namespace=NS, layout_fp=LAYOUT_FP) == 0
            assert tier.counters.checksum_failures == 1
            assert tier.stats_extra()["protocol_errors"] == 0 and tier.up

    with peer(tmp_path, answering(answer), name="giant.sock", read_first=False,
              concurrent=True) as addr:
        asyncio.run(main(f"unix://{addr.host}"))


def test_a_job_that_timed_out_never_leaves_its_connection_idle(tmp_path: Path) -> None:
    """A server that never answers a GET pipeline: the job fails at its deadline and its
    connection is discarded. Pooled instead, the late reply would be read by the next
    exchange on it as its own (a probe's count, a block's value)."""
    def silent(sock: socket.socket) -> None:
        while sock.recv(1 << 16):
            pass

    got: list[object] = []
    with peer(tmp_path, silent, name="silent.sock") as addr:
        pool = NodePool(addr, ConnOptions(connect_timeout_s=1.0, op_timeout_s=0.3), 2)
        try:
            job = GetJob(addr, [b"k"], 8, lambda _i, _h, _n: None,
                         lambda _i, reply: got.append(reply))
            read_jobs([job], lambda _n: pool, 1, lambda _j: True)
            assert isinstance(job.error, TimeoutError) and got == [job.error]
            assert pool.take_idle() is None
        finally:
            pool.close()
