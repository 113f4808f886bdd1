"""The daemon's live miss-ratio curve against a replay of the same references.

A daemon with the adaptive policy (its default), a small cpu tier and no nvme tier is
driven by a seeded prefix-sharing workload through the client; its exported curve
(/v1/stats ``policy.tiers.cpu.mrc``, Prometheus ``kvtier_policy_mrc_hit_rate``) must match
``kvtier replay``'s simulator run on the same references at 0.5x, 1x and 2x the tier.
The shadows sample every key here (``shadow_sample_rate = 1``): a tier of 24 blocks is far
too small for a sampled miniature, and the point is the wiring and the semantics.
"""

from __future__ import annotations

import random
import urllib.request

import numpy as np

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.replay.simulator import SimConfig, TierSpec, simulate
from kvtier.replay.trace import Request, Trace, TraceFormat

LAYOUT = KVLayout(2, 2, 32, "float16", 64)  # 32 KiB blocks of 64 tokens
CPU_BLOCKS = 24


def _prompts(n: int, seed: int = 11) -> list[np.ndarray]:
    rng = random.Random(seed)
    prefixes = [np.arange(64 * rng.randint(2, 6)) + 100_000 * (i + 1) for i in range(12)]
    weights = [1.0 / (i + 1) for i in range(12)]
    fresh = 10_000_000
    out = [np.arange(64) + 7]  # a one-block first request: the shadows size at its put
    for _ in range(n):
        k = rng.randint(1, 3) if rng.random() < 0.7 else rng.randint(2, 8)
        tail = np.arange(64 * k) + fresh
        fresh += 64 * k
        if rng.random() < 0.7:
            head = prefixes[rng.choices(range(12), weights)[0]]
            out.append(np.concatenate([head, tail]))
        else:
            out.append(tail)
    return out


def test_exported_curve_matches_a_replay_of_the_same_references(daemon_factory) -> None:
    d = daemon_factory("mrc", cpu_bytes=str(CPU_BLOCKS * LAYOUT.block_bytes), nvme_bytes="0",
                       env={"KVTIER_POLICY_SHADOW_SAMPLE_RATE": "1.0"}).start()
    c = connect(d.socket)
    ns = c.register_layout(LAYOUT, "m")
    buf = np.zeros(LAYOUT.block_bytes, np.uint8)
    ids: dict[bytes, int] = {}
    reqs = []
    for i, prompt in enumerate(_prompts(500)):
        keys = block_keys(ns, prompt)
        c.lookup(ns, keys)
        c.put(ns, keys, [buf] * len(keys), output_tokens=50)
        blocks = tuple(ids.setdefault(bytes(k), len(ids)) for k in keys)
        reqs.append(Request(float(i), 64 * len(keys), 50, blocks))
    stats = c.stats()
    cpu = stats["policy"]["tiers"]["cpu"]
    assert stats["policy"]["eviction"] == "adaptive"
    assert cpu["capacity_blocks"] == CPU_BLOCKS and cpu["sample_rate"] == 1.0
    curve = {p["scale"]: p["hit_rate"] for p in cpu["mrc"]}
    assert set(curve) == {0.25, 0.5, 1.0, 2.0, 4.0}
    trace = Trace(tuple(reqs), 64, TraceFormat.MOONCAKE)
    for scale in (0.5, 1.0, 2.0):
        cfg = SimConfig(tiers=(TierSpec("cpu", int(CPU_BLOCKS * scale), 25e9),))
        replay = simulate(trace, cpu["mode"], cfg).token_hit_rate
        assert abs(curve[scale] - replay) <= 0.03, (scale, curve[scale], replay)
    # a bigger tier hits more: the curve is not flat noise
    assert curve[4.0] > curve[1.0] > curve[0.25]
    # the same numbers are Prometheus gauges
    with urllib.request.urlopen(d.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'kvtier_policy_mrc_hit_rate{scale="2",tier="cpu"}' in text
    assert f'kvtier_policy_mode{{mode="{cpu["mode"]}",tier="cpu"}} 1.0' in text
    # every lookup was learned (a put replays the queue first): none was dropped
    assert stats["policy"]["lookups_dropped"] == 0
    assert "kvtier_policy_lookups_dropped_total 0.0" in text
