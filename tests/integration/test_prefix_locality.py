"""Prefix locality (POST /v1/prefix and the prefix_locality op) against real daemons: it
agrees with a lookup, splits the local prefix by tier, sees a second node's blocks in a
real Redis, and leaves no trace (no promotion, no lookup counted, nothing registered)."""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.client import connect
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.prefix import PrefixLocality, RedisProbe
from tests.support.daemon import DaemonProcess
from tests.support.redis_servers import RedisServer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)  # 32 KiB blocks
TPB = LAYOUT.tokens_per_block


def content(key: bytes) -> np.ndarray:
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def post(node: DaemonProcess, body: bytes, content_type: str = "application/json",
         query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    url = node.http_url + "/v1/prefix"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post_json(node: DaemonProcess, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return post(node, json.dumps(doc).encode())


def wait_for(pred: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def prompts() -> dict[str, np.ndarray]:
    """Token ids of prompts that share, partly share or do not share the stored prefix."""
    base = np.arange(1000, 1000 + 12 * TPB, dtype=np.int64)
    diverged = base.copy()
    diverged[5 * TPB + 3] = 7          # block 5 differs: 5 leading blocks match
    return {"full": base, "longer": np.concatenate([base, np.arange(3 * TPB + 17)]),
            "diverged": diverged, "partial_tail": base[: 4 * TPB + 10],
            "unknown": np.arange(5 * TPB) + 90_000, "empty": np.zeros(0, dtype=np.int64)}


def test_probe_agrees_with_lookup_by_tier_and_leaves_no_trace(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    stored = block_keys(ns, prompts()["full"])
    assert c.put(ns, stored, [content(k) for k in stored], durable=True) == 12
    # a cold restart keeps only nvme: then promote the first 3 blocks back into the arena
    daemon.restart()
    c.close()
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    assert c.lookup(ns, stored[:3]).hits == 3
    with c.prepare_get(ns, stored[:3]) as lease:   # waits for the promotion
        assert len(lease.views) == 3
    before = daemon.stats()

    probes = {name: c.prefix_locality(ns, toks) for name, toks in prompts().items()}
    batch = c.prefix_locality_batch(ns, list(prompts().values()))
    assert batch == list(probes.values())
    after = daemon.stats()
    # no trace: no lookup counted, nothing promoted, the tiers hold what they held
    assert after["requests"]["lookups"] == before["requests"]["lookups"]
    assert after["tiers"]["cpu"]["blocks"] == before["tiers"]["cpu"]["blocks"] == 3
    assert after["prefetch"] == before["prefetch"]

    want_hits = {"full": 12, "longer": 12, "diverged": 5, "partial_tail": 4, "unknown": 0,
                 "empty": 0}
    for name, toks in prompts().items():
        p = probes[name]
        keys = block_keys(ns, toks)
        found = c.lookup(ns, keys, prefetch=False) if keys else None
        hits = found.hits if found else 0
        assert p.hit_blocks == hits == want_hits[name], name
        assert p.local_blocks == hits and p.prompt_blocks == len(keys), name
        assert p.tier_blocks == {"cpu": found.tiers.count("cpu") if found else 0,
                                 "nvme": found.tiers.count("nvme") if found else 0}, name
        assert p.hit_tokens == hits * TPB and p.tokens_per_block == TPB
        assert p.redis is RedisProbe.OFF and p.redis_blocks == 0
    assert probes["full"].tier_blocks == {"cpu": 3, "nvme": 9}

    # another tenant (cache_salt) sees nothing of it
    salted = Namespace("m", LAYOUT, cache_salt="tenant-b")
    assert c.prefix_locality(salted, prompts()["full"]).hit_blocks == 0
    c.close()


def test_http_forms_agree_and_refusals_are_typed(daemon: DaemonProcess) -> None:
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m")
    toks = prompts()["full"]
    keys = block_keys(ns, toks)
    assert c.put(ns, keys[:7], [content(k) for k in keys[:7]]) == 7
    via_client = c.prefix_locality(ns, toks).to_dict()
    u4 = toks.astype("<u4").tobytes()
    spelled = {"model_id": "m", "layout": LAYOUT.to_dict()}
    forms = [
        {"namespace": ns.digest.hex(), "token_ids": toks.tolist()},
        {"model_id": "m", "tokens_b64": base64.b64encode(u4).decode()},   # registered one
        {**spelled, "block_keys": [k.hex() for k in keys]},
    ]
    for doc in forms:
        status, reply = post_json(daemon, doc)
        assert (status, reply) == (200, via_client), doc.keys()
    status, reply = post(daemon, u4, "application/octet-stream", {"model_id": "m"})
    assert (status, reply) == (200, via_client)
    assert via_client["hit_tokens"] == 7 * TPB and via_client["redis"] == "off"

    # batches: JSON with a per-prompt namespace override, and binary with lengths
    other = prompts()["diverged"]
    status, reply = post_json(daemon, {**spelled, "prompts": [
        {"token_ids": toks.tolist()}, {"token_ids": other.tolist()},
        {"token_ids": toks.tolist(), "cache_salt": "t2"}]})
    assert status == 200
    assert [r["hit_blocks"] for r in reply["results"]] == [7, 5, 0]
    body = u4 + other.astype("<u4").tobytes()
    status, reply = post(daemon, body, "application/octet-stream",
                         {"namespace": ns.digest.hex(), "lengths": f"{len(toks)},{len(other)}"})
    assert status == 200 and [r["hit_blocks"] for r in reply["results"]] == [7, 5]
    status, reply = post(daemon, b"".join(keys), "application/octet-stream",
                         {"namespace": ns.digest.hex(), "input": "keys"})
    assert (status, reply) == (200, via_client)

    # refusals: typed, with a status a router can act on
    assert post_json(daemon, {"model_id": "nobody", "token_ids": [1]})[0] == 404
    assert post_json(daemon, {"namespace": "00" * 16, "token_ids": [1]})[0] == 404
    status, reply = post_json(daemon, {"model_id": "m", "token_ids": [-1] * 10})
    assert status == 400 and reply["code"] == "protocol"
    status, reply = post(daemon, b"\x00" * 4 * (2**17 + 1), "application/octet-stream",
                         {"model_id": "m"})
    assert status == 413 and reply["code"] == "limit"
    assert post(daemon, u4[:-1], "application/octet-stream", {"model_id": "m"})[0] == 400
    assert post(daemon, b"x", "text/plain")[0] == 400
    assert post(daemon, b"{not json")[0] == 400
    status, _ = post_json(daemon, {**spelled, "prompts": [{"token_ids": [1]}] * 257})
    assert status == 413
    # a second layout of the same model makes the short form ambiguous
    c.register_layout(KVLayout(2, 2, 32, "float16", tokens_per_block=32), "m")
    status, reply = post_json(daemon, {"model_id": "m", "token_ids": toks.tolist()})
    assert status == 400 and "layout" in reply["error"]
    # probes registered nothing: the daemon knows the namespaces the client registered
    assert daemon.stats()["requests"]["lookups"] == 0
    c.close()


def test_second_node_sees_the_first_nodes_blocks_in_redis(
        redis_server: RedisServer, daemon_factory: Callable[..., DaemonProcess]) -> None:
    env = {"KVTIER_REDIS_WRITE_THROUGH": "true"}
    node_a = daemon_factory("a", extra_args=["--redis-url", redis_server.url], env=env).start()
    node_b = daemon_factory("b", extra_args=["--redis-url", redis_server.url], env=env).start()
    ca, cb = connect(node_a.socket), connect(node_b.socket)
    ns = ca.register_layout(LAYOUT, "m")
    toks = prompts()["full"]
    keys = block_keys(ns, toks)
    assert ca.put(ns, keys[:9], [content(k) for k in keys[:9]]) == 9
    wait_for(lambda: cb.prefix_locality(ns, toks).redis_blocks == 9)

    on_a, on_b = ca.prefix_locality(ns, toks), cb.prefix_locality(ns, toks)
    assert (on_a.local_blocks, on_a.redis_blocks, on_a.hit_blocks) == (9, 9, 9)
    assert (on_b.local_blocks, on_b.redis_blocks, on_b.hit_blocks) == (0, 9, 9)
    assert on_b.redis is RedisProbe.OK
    assert cb.stats()["tiers"]["cpu"]["blocks"] == 0        # the probe promoted nothing
    # node B holds 4 blocks of its own and 2 more that Redis lacks: the lookup's answer
    # is B's local prefix then Redis after it, and redis_blocks still counts from block 0
    other = prompts()["diverged"]
    okeys = block_keys(ns, other)
    assert okeys[:5] == keys[:5]
    ns_b = cb.register_layout(LAYOUT, "m")
    assert cb.put(ns_b, okeys[:7], [content(k) for k in okeys[:7]]) == 7
    wait_for(lambda: cb.prefix_locality(ns, other).redis_blocks == 7)
    probe = cb.prefix_locality(ns, toks)
    assert probe.local_blocks == 5 and probe.redis_blocks == 9
    assert probe.hit_blocks == cb.lookup(ns_b, keys, prefetch=False).hits == 9
    skipped = cb.prefix_locality(ns, toks, redis=False)
    assert (skipped.redis, skipped.hit_blocks) == (RedisProbe.SKIPPED, 5)
    redis_server.kill()
    wait_for(lambda: cb.prefix_locality(ns, toks).redis is RedisProbe.DOWN)
    down = cb.prefix_locality(ns, toks)
    assert down.hit_blocks == 5 and down.redis_blocks == 0
    assert PrefixLocality.from_dict(down.to_dict()) == down
    ca.close()
    cb.close()


def test_a_salted_namespace_is_not_named_by_its_digest_alone(daemon: DaemonProcess) -> None:
    """A digest is shown in places and proves nothing: /v1/prefix names a salted
    namespace by its salt only, and /v1/lookups/recent shows no digest."""
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "m", cache_salt="tenant-a")
    toks = prompts()["full"]
    keys = block_keys(ns, toks)
    assert c.put(ns, keys[:3], [content(k) for k in keys[:3]]) == 3
    assert c.lookup(ns, keys).hits == 3
    with urllib.request.urlopen(daemon.http_url + "/v1/lookups/recent", timeout=10) as r:
        recent = r.read().decode()
    assert ns.digest.hex() not in recent and "tenant-a" not in recent
    status, reply = post_json(daemon, {"namespace": ns.digest.hex(), "token_ids": toks.tolist()})
    assert status == 404 and reply["code"] == "unknown_namespace"
    salted = {"model_id": "m", "layout": LAYOUT.to_dict(), "cache_salt": "tenant-a"}
    status, reply = post_json(daemon, {**salted, "token_ids": toks.tolist()})
    assert status == 200 and reply["hit_blocks"] == 3
    # over the socket, the connection that registered it may name it by its digest
    assert c.prefix_locality(ns, toks).hit_blocks == 3
    # absurd layout numbers are a typed refusal, not a server error
    huge: dict[str, Any] = {**salted, "layout": {**LAYOUT.to_dict(), "num_layers": 2**80},
                            "token_ids": [1]}
    assert post_json(daemon, huge)[0] == 400
    c.close()


def test_a_router_names_a_model_without_its_weights_fingerprint(daemon: DaemonProcess) -> None:
    """The vLLM connector registers ``MODEL#w=FINGERPRINT`` (kvtier.weights); a router
    knows the model's name only: by name, with or without the layout, it probes the
    registered namespace. Two weights of one name registered at once are told apart."""
    c = connect(daemon.socket)
    ns = c.register_layout(LAYOUT, "org/model#w=00112233aabbccdd")
    toks = prompts()["full"]
    keys = block_keys(ns, toks)
    assert c.put(ns, keys[:5], [content(k) for k in keys[:5]]) == 5
    for doc in ({"model_id": "org/model"},
                {"model_id": "org/model", "layout": LAYOUT.to_dict()},
                {"model_id": "org/model#w=00112233aabbccdd", "layout": LAYOUT.to_dict()}):
        status, reply = post_json(daemon, {**doc, "token_ids": toks.tolist()})
        assert status == 200 and reply["hit_tokens"] == 5 * TPB, (doc, reply)
    c.register_layout(LAYOUT, "org/model#w=ffffffffffffffff")   # new weights, same name
    status, reply = post_json(daemon, {"model_id": "org/model", "token_ids": toks.tolist()})
    assert status == 400 and "org/model#w=ffffffffffffffff" in reply["error"], reply
    status, reply = post_json(daemon, {"model_id": "org/model#w=ffffffffffffffff",
                                       "token_ids": toks.tolist()})
    assert status == 200 and reply["hit_tokens"] == 0    # its blocks are not the old ones'
    # one model, two layouts alike but for their depth: the refusal tells them apart
    deeper = dataclasses.replace(LAYOUT, num_layers=LAYOUT.num_layers + 1)
    c.register_layout(deeper, "org/other")
    c.register_layout(LAYOUT, "org/other")
    status, reply = post_json(daemon, {"model_id": "org/other", "token_ids": toks.tolist()})
    assert status == 400, reply
    assert f"num_layers {LAYOUT.num_layers}," in reply["error"]
    assert f"num_layers {deeper.num_layers}," in reply["error"]
    c.close()
