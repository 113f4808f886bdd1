"""A producer's prompt longer than its daemon's put share, or than its whole arena, still
reaches Redis whole before the request is reported finished (review of 2026-12-06: with
a 2 MiB arena, a 23-block prompt had 16 blocks in Redis at request end, the rest given up
on, and a 46-block prompt none, its put refused as larger than the arena). The producer
cuts its save into pieces of at most half the put share the daemon announces, each
committed to Redis before the next is prepared."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import Zygote
from tests.e2e.pd_support import LAYOUT, role_config, run_pd_engine
from tests.e2e.vllm_engine import TOKENS_PER_BLOCK, prompt
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import running_server

pytestmark = pytest.mark.e2e


def test_prompts_longer_than_the_producers_arena_reach_redis_whole(
        tmp_path: Path, tiny_model: Path, zygote: Zygote) -> None:
    assert 2 * 2**20 // LAYOUT.block_bytes == 32                # a 32-block arena
    prompts = [prompt(41, 1500), prompt(40, 3000)]             # 23 and 46 blocks
    with running_server(tmp_path / "redis") as redis:
        env = {"KVTIER_REDIS_WRITE_THROUGH": "false", "KVTIER_REDIS_LOOKUP_BUDGET_S": "2.0"}
        a = DaemonProcess(tmp_path / "node-a", cpu_bytes="2MiB", nvme_bytes="0",
                          extra_args=["--redis-url", redis.url], env=env)
        b = DaemonProcess(tmp_path / "node-b", cpu_bytes="64MiB", nvme_bytes="0",
                          extra_args=["--redis-url", redis.url], env=env)
        with a, b:
            (tmp_path / "producer").mkdir()
            rows, counters = run_pd_engine(tmp_path / "producer", tiny_model,
                                           role_config(a, "kv_producer"), prompts, 1, probe=b,
                                           zygote=zygote)
            want = [len(p) // TOKENS_PER_BLOCK for p in prompts]
            assert [row[3] for row in rows] == want, "blocks in Redis at request end"
            assert counters.get("redis_sync_gave_up", 0) == 0
            assert a.stats()["daemon"]["redis_sync"]["gave_up"] == 0
