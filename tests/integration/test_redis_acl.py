"""kvtier under a least-privilege Redis user (docs/redis.md, "Who can write what kvtier
reads"): an ACL user limited to the ``kvtier:*`` keys and the commands the tier sends is
enough for write-through, synchronous commits, reads by another node and deletes, and the
tier never needs a command outside that list (no error counted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer
from tests.support.redis_tier import ACL_RULE

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "redis.md"


def test_the_rule_is_the_one_the_docs_give() -> None:
    documented = f"ACL SETUSER kvtier {ACL_RULE.replace('>s3cret', '>PASSWORD')}"
    assert documented in DOCS.read_text()


def test_a_user_limited_to_kvtier_keys_and_commands_is_enough(
        redis_server: RedisServer, daemon_factory: Callable[..., DaemonProcess]) -> None:
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "kvtier", *ACL_RULE.split())
    url = f"redis://kvtier:s3cret@127.0.0.1:{redis_server.port}/0"
    env = {"KVTIER_REDIS_WRITE_THROUGH": "true"}
    a, b = (daemon_factory(n, extra_args=["--redis-url", url], env=env).start()
            for n in ("a", "b"))
    ca, cb = connect(a.socket), connect(b.socket)
    try:
        ns, ns_b = ca.register_layout(LAYOUT, "m"), cb.register_layout(LAYOUT, "m")
        keys = block_keys(ns, np.arange(8 * 64))
        data = [np.full(LAYOUT.block_bytes, i + 1, np.uint8) for i in range(len(keys))]
        lease = ca.prepare_put(ns, keys)
        for view, block in zip(lease.views, data, strict=True):
            assert view is not None
            np.copyto(view, block)
        assert lease.commit(redis_sync_s=5.0) == len(keys)
        assert lease.redis_synced and lease.redis_visible == len(keys)
        assert cb.lookup(ns_b, keys).hits == len(keys)
        outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in keys]
        assert cb.get(ns_b, keys, outs) == len(keys)
        assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))
        assert cb.delete(ns_b, keys) == len(keys)
        assert admin.dbsize() == 0
        for node in (a, b):
            stats = node.stats()["tiers"]["redis"]
            assert stats["up"] and stats["errors"] == 0, stats
        # the user really is limited: it cannot touch another application's keys
        limited = redis.Redis(host="127.0.0.1", port=redis_server.port, username="kvtier",
                              password="s3cret")
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                limited.set("other:app", b"x")
        finally:
            limited.close()
    finally:
        ca.close()
        cb.close()
