"""Block keys are the same in every process, whatever its hash seed (keys must match across
engines and the daemon). (Moved from the unit tests: it starts processes.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtier.keys import block_keys
from tests.support.keys import TOKENS, ns

REPO = Path(__file__).resolve().parents[2]

_KEYS_SCRIPT = """
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
ns = Namespace("org/model-7b", KVLayout(2, 2, 8, "float16", tokens_per_block=4), 1, 2, "tenant")
print(",".join(k.hex() for k in block_keys(ns, list(range(1000, 1016)))))
print(ns.digest.hex())
"""


def keys_in_subprocess(hashseed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout


def test_keys_identical_across_processes_with_different_hash_seeds() -> None:
    a = keys_in_subprocess("1")
    b = keys_in_subprocess("12345")
    assert a == b
    here = ns(tp_rank=1, tp_size=2, cache_salt="tenant")
    assert a.splitlines() == [",".join(k.hex() for k in block_keys(here, TOKENS)),
                              here.digest.hex()]
