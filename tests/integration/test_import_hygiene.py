"""Importing kvtier never imports a GPU library: checked in a fresh interpreter, where
nothing else has imported them yet. (Moved from the unit tests: these start processes.)"""

from __future__ import annotations

import subprocess
import sys


def fresh_python(code: str) -> str:
    """``code``'s output in a fresh interpreter; it must exit 0."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_no_gpu_library_is_imported_at_module_top() -> None:
    code = ("import sys, kvtier.tiers.nvme.backends, kvtier.tiers.nvme.kvikio_io, "
            "kvtier.tiers.hbm, kvtier.tiers.nvme, kvtier.daemon.service\n"
            "bad = [m for m in ('cupy', 'kvikio', 'torch') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_needs_no_torch_or_cupy():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['cupy'] = None; "
            "import kvtier.kernels, kvtier.kernels.cuda, kvtier.kernels.cuda_stream; "
            "print(kvtier.kernels.PagedLayout.CPU.value)")
    assert fresh_python(code) == "cpu"


def test_the_redis_tier_needs_no_redis_py() -> None:
    """A daemon installed without the ``redis`` extra died with a traceback
    (ModuleNotFoundError from redis.crc) as soon as redis.enabled was set: the tier's one
    use of redis-py was the cluster hash slot, now kvtier.tiers.redis_route.key_slot."""
    code = ("import sys; sys.modules['redis'] = None\n"
            "from kvtier.config import Config\n"
            "from kvtier.daemon.parts import make_redis\n"
            "print(type(make_redis(Config())).__name__)")
    assert fresh_python(code) == "RedisTier"
