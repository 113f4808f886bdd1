"""Prompt chains with key-derived block bytes, for tests that kill a daemon under load and
check every byte it serves afterwards (also imported by their client subprocesses)."""

from __future__ import annotations

import numpy as np

from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)   # 32 KiB blocks
HEAD_TOKENS = 64                         # one shared block: the "system prompt" of every chain
CHAIN_TOKENS = 4 * 64


def content(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def chain_keys(ns: Namespace, client: int, i: int) -> list[bytes]:
    """Chain ``i`` of client ``client``: the shared head block, then 3 blocks of its own."""
    own = 10_000_000 * (client + 1) + i * (CHAIN_TOKENS - HEAD_TOKENS)
    tokens = np.concatenate([np.arange(HEAD_TOKENS),
                             own + np.arange(CHAIN_TOKENS - HEAD_TOKENS)])
    return [bytes(k) for k in block_keys(ns, tokens)]
