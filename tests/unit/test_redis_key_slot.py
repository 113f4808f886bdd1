"""The tier's own Redis Cluster hash slot (kvtier.tiers.redis_route.key_slot) agrees with
redis-py's on plain keys and hash tags. (That the tier imports without redis-py is
tests/integration/test_import_hygiene.py.)"""

from __future__ import annotations

import random

import pytest
from redis.crc import key_slot as redis_py_key_slot

from kvtier.tiers.redis_route import key_slot


@pytest.mark.parametrize("key", [
    b"", b"kvtier:abc", b"{user1000}.following", b"foo{}{bar}", b"foo{{bar}}zap",
    b"foo{bar}{zap}", b"{", b"}{", b"a{b", b"\xff\x00{\x01}",
    # the tier's own key form: prefix, namespace-free 16-byte key in hex, stripe suffix
    b"kvtier:" + bytes(range(16)).hex().encode() + b":s3",
])
def test_key_slot_matches_redis_py(key: bytes) -> None:
    assert key_slot(key) == redis_py_key_slot(key)


def test_key_slot_matches_redis_py_on_random_keys() -> None:
    rng = random.Random(5)
    for _ in range(5000):
        key = rng.randbytes(rng.randrange(0, 40))
        assert key_slot(key) == redis_py_key_slot(key), key
