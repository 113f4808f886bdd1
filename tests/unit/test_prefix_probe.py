"""The prefix-locality probe in-process (real arena, no tiers below): any request a client
or router can send is answered or refused with a typed error, never a crash, and the
bounds of kvtier.daemon.limits hold."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.daemon.limits import Limits
from kvtier.daemon.prefix import MAX_PROMPTS, PrefixProbe
from kvtier.daemon.prefix_input import digest_of, json_prompt, json_values, split_prompts
from kvtier.errors import KVTierError, LimitExceeded, ProtocolError
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.arena import Arena
from tests.support.arena import temp_arena

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  tokens_per_block=16)
LIMITS = Limits(max_context_tokens=1024)


@pytest.fixture(scope="module")
def arena() -> Iterator[Arena]:
    with temp_arena(64 * LAYOUT.block_bytes, LAYOUT.block_bytes) as a:
        yield a


@pytest.fixture(scope="module")
def probe(arena: Arena) -> PrefixProbe:
    store = TieredStore(arena)
    store.register_namespace(LAYOUT, "m", 0, 1, None)
    return PrefixProbe(store, LIMITS)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=80),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=12)
fields = st.sampled_from(["ns", "namespace", "model_id", "layout", "tp_rank", "tp_size",
                          "cache_salt", "tokens", "keys", "lengths", "redis", "prompts",
                          "token_ids", "tokens_b64", "block_keys"])

# half the requests name a real namespace, so the fuzz reaches past its resolution
bases = st.sampled_from([{}, {"model_id": "m"}, {"model_id": "m", "layout": LAYOUT.to_dict()}])
requests = st.builds(lambda base, extra: {**base, **extra}, bases,
                     st.dictionaries(fields, values | st.binary(max_size=200), max_size=6))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=requests)
def test_any_control_request_is_answered_or_typed(probe: PrefixProbe,
                                                  msg: dict[str, Any]) -> None:
    try:
        reply = run(probe.from_control(msg))
    except KVTierError:
        return
    assert all(r["hit_blocks"] == 0 for r in reply["results"])   # nothing is stored


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=requests,
       kind=st.sampled_from(["application/json", "application/octet-stream", "text/x"]))
def test_any_http_body_is_answered_or_typed(probe: PrefixProbe, doc: dict[str, Any],
                                            kind: str) -> None:
    body = json.dumps(doc, default=repr).encode() if kind != "application/octet-stream" \
        else msgpack.packb(doc, default=repr)
    query = {k: str(v) for k, v in doc.items()}
    try:
        run(probe.from_http(body, kind, query))
    except KVTierError:
        return


def test_bounds_are_the_daemons(probe: PrefixProbe) -> None:
    ns = Namespace("m", LAYOUT)
    spec = {"model_id": "m"}
    at_limit = np.zeros(LIMITS.max_context_tokens, dtype="<u4").tobytes()
    reply = run(probe.from_control({**spec, "tokens": at_limit}))
    assert reply["results"][0]["prompt_blocks"] == LIMITS.max_context_tokens // 16
    with pytest.raises(LimitExceeded):
        run(probe.from_control({**spec, "tokens": at_limit + b"\0\0\0\0"}))
    keys = block_keys(ns, np.arange(LIMITS.max_context_tokens + 16))
    with pytest.raises(LimitExceeded):
        run(probe.from_control({**spec, "keys": b"".join(keys)}))
    with pytest.raises(LimitExceeded):   # four contexts in one batch at most
        run(probe.from_control({**spec, "tokens": at_limit * 5, "lengths": [1024] * 5}))
    with pytest.raises(LimitExceeded):
        run(probe.from_control({**spec, "tokens": b"", "lengths": [0] * (MAX_PROMPTS + 1)}))
    with pytest.raises(LimitExceeded):
        run(probe.from_http(b" " * (4 * 2**20 + 1), "application/json", {}))


def test_a_long_probe_takes_turns_with_the_other_clients(arena: Arena) -> None:
    """Hashing and walking a batch of long prompts (one token per block: 1024 keys each
    here) gives the event loop back between pieces, as the store's own loops do; the keys
    it computes in pieces are the chain's, so the answer is the same."""
    fine = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                    tokens_per_block=1)
    store = TieredStore(arena)
    ns = store.register_namespace(fine, "fine", 0, 1, None)
    probe = PrefixProbe(store, LIMITS)
    tokens = np.arange(LIMITS.max_context_tokens, dtype="<u4")
    ticks = 0

    async def main() -> dict[str, Any]:
        nonlocal ticks
        stop = asyncio.Event()

        async def other_client() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_client())
        await asyncio.sleep(0)
        slow = [0] * 400_000   # each piece of the work takes longer than a turn (1 ms)

        def spin(*_: Any) -> None:
            sum(slow)

        import kvtier.daemon.prefix as module
        real = module.block_keys

        def slow_keys(*args: Any, **kwargs: Any) -> Any:
            spin()
            return real(*args, **kwargs)

        module.block_keys = slow_keys
        try:
            before = ticks
            reply = await probe.from_control({"model_id": "fine", "tokens": tokens.tobytes() * 4,
                                              "lengths": [len(tokens)] * 4, "redis": False})
            during = ticks - before
        finally:
            module.block_keys = real
            stop.set()
            await ticker
        # a pause before each of the 8 pieces but the first (without turns, the other
        # client ran only while the probes' tasks were scheduled: 1-2 times)
        assert during >= 7, during
        return reply

    reply = run(main())
    assert [r["prompt_blocks"] for r in reply["results"]] == [len(tokens)] * 4
    whole = block_keys(ns, tokens)
    assert run(probe.probe(ns, whole, redis=False)).to_dict() == reply["results"][0]


def test_namespaces_are_found_by_model_name_without_a_scan(arena: Arena) -> None:
    """A router names a model (with or without its weights fingerprint): the registry
    indexes its namespaces by that name, and forgets them with the namespace."""
    store = TieredStore(arena, max_namespaces=3)
    a = store.register_namespace(LAYOUT, "llama#w=0123456789abcdef", 0, 1, None)
    b = store.register_namespace(LAYOUT, "llama", 0, 1, "salt")
    assert store.namespaces_named("llama", None, 0, 1) == [a]
    assert store.namespaces_named("llama#w=0123456789abcdef", None, 0, 1) == [a]
    assert store.namespaces_named("llama", "salt", 0, 1) == [b]
    assert store.namespaces_named("llama", None, 1, 2) == []
    for i in range(3):   # a is the least recently used: forgotten first
        store.register_namespace(LAYOUT, f"other{i}", 0, 1, None)
    assert store.namespaces_named("llama", None, 0, 1) == []
    assert "llama" not in {n.model_id for n in store.namespaces_named("llama", "salt", 0, 1)}


def test_a_layout_keeps_a_bounded_kv_format() -> None:
    from kvtier.errors import LayoutMismatch
    from kvtier.layout import MAX_KV_FORMAT

    ok = dict(LAYOUT.to_dict(), kv_format="f" * MAX_KV_FORMAT)
    assert KVLayout.from_dict(ok).kv_format == "f" * MAX_KV_FORMAT
    with pytest.raises(LayoutMismatch, match="at most 256 characters"):
        KVLayout.from_dict(dict(ok, kv_format="f" * (MAX_KV_FORMAT + 1)))


def test_json_bodies_are_bounded_before_they_are_parsed(probe: PrefixProbe) -> None:
    """Parsing JSON costs event-loop time per value (a 4 MiB body of 2M ints: 150 ms), so
    a JSON body has its own bounds, from max_context_tokens, checked before it is parsed:
    bytes (also from the declared length, before the body is read) and values."""
    ctx = LIMITS.max_context_tokens
    assert probe.json_max_values >= 2 * ctx
    assert 8 * 2 * ctx <= probe.json_max_bytes < 4 * 2**20
    many = json.dumps({"model_id": "nobody", "token_ids": [0] * (probe.json_max_values + 1)},
                      separators=(",", ":")).encode()
    assert len(many) < probe.json_max_bytes   # few bytes, too many values: not parsed
    with pytest.raises(LimitExceeded, match="application/octet-stream"):
        run(probe.from_http(many, "application/json", {}))
    with pytest.raises(LimitExceeded, match="application/octet-stream"):
        probe.http_limit("application/json", {}, probe.json_max_bytes + 1)
    assert probe.http_limit("application/json", {}, 100) == probe.json_max_bytes
    # a prompt at the context limit fits, as a 6-digit-vocabulary router writes it
    doc = {"model_id": "m", "token_ids": [151643] * ctx}
    assert len(json.dumps(doc).encode()) < probe.json_max_bytes
    assert run(probe.from_http(json.dumps(doc).encode(), "application/json", {}))[
        "prompt_blocks"] == ctx // 16


def test_a_key_batch_over_its_budget_is_refused_before_it_is_split(
        probe: PrefixProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """256 prompts of max_keys keys each: every prompt within its bound, the batch 64x over
    its budget; refused from the blob's length (and the query's lengths) before a key object
    is built (a million of them cost ~0.1 s of the event loop)."""
    max_keys = LIMITS.max_keys(16)
    blob = b"k" * 16 * max_keys * MAX_PROMPTS
    lengths = [max_keys] * MAX_PROMPTS

    def no_split(raw: bytes) -> list[bytes]:
        raise AssertionError("keys split before the batch budget was checked")

    monkeypatch.setattr(TieredStore, "split_keys", staticmethod(no_split))
    with pytest.raises(LimitExceeded, match="split it"):
        run(probe.from_control({"model_id": "m", "keys": blob, "lengths": lengths}))
    query = {"model_id": "m", "input": "keys", "lengths": ",".join(map(str, lengths))}
    with pytest.raises(LimitExceeded, match="split it"):
        run(probe.from_http(blob, "application/octet-stream", query))
    with pytest.raises(LimitExceeded, match="split it"):   # from the head, before the body
        probe.http_limit("application/octet-stream", query, len(blob))


def test_nested_json_counts_against_the_values_bound(probe: PrefixProbe) -> None:
    """(found by review) The values were counted from commas only: 320 KiB of 500-deep
    `[[[...]]]` (163k lists, few commas) passed and held the loop 25-137 ms. Brackets,
    braces and colons count too, before the body is parsed."""
    unit = "[" * 500 + "]" * 500
    n = (probe.json_max_values + 499) // 500
    body = ('{"model_id": "m", "token_ids": [1], "x": [' + ",".join([unit] * n)
            + "]}").encode()
    assert len(body) < probe.json_max_bytes and body.count(b",") < n + 4
    with pytest.raises(LimitExceeded, match="application/octet-stream"):
        run(probe.from_http(body, "application/json", {}))
    flat = {"model_id": "m", "token_ids": [151643] * LIMITS.max_context_tokens,
            "prompts_meta": {"a": 1}}   # an ordinary body: a few containers and colons
    assert "prompt_blocks" in run(probe.from_http(json.dumps(flat).encode(),
                                                  "application/json", {}))


def test_a_salt_with_a_layout_answers_alike_whether_registered_or_not(arena: Arena) -> None:
    """(found by review) Form 3 (model_id + layout + cache_salt) was resolved against the
    namespaces registered with that salt: while a tenant had two weights of a model
    registered (a rollout), its salt answered 400 ("2 namespaces...") and a wrong one 200
    with 0 blocks. Every salt is now resolved against the model's namespaces of any salt."""
    store = TieredStore(arena)
    for weights in ("1111111111111111", "2222222222222222"):
        store.register_namespace(LAYOUT, f"acme#w={weights}", 0, 1, "acme-salt")
    p = PrefixProbe(store, LIMITS)
    layout = LAYOUT.to_dict()
    answers = []
    for salt in ("acme-salt", "a-guess"):
        for spec in ({"model_id": "acme", "cache_salt": salt, "layout": layout},
                     {"model_id": "acme", "cache_salt": salt}):
            with pytest.raises(KVTierError) as err:
                p.namespace(spec)
            answers.append((type(err.value), str(err.value)))
    assert answers[0] == answers[2] and answers[1] == answers[3], answers
    assert "2 namespaces" in answers[0][1]
    # the full id names one of them, for any salt, spelled with the salt given
    for salt in ("acme-salt", "a-guess"):
        ns = p.namespace({"model_id": "acme#w=1111111111111111", "cache_salt": salt,
                          "layout": layout})
        assert ns == Namespace("acme#w=1111111111111111", LAYOUT, 0, 1, salt)


# -- wire forms (kvtier.daemon.prefix_input) -------------------------------------------------
def test_lengths_that_leave_bytes_of_the_body_uncounted_are_refused(probe: PrefixProbe) -> None:
    """``lengths`` must add up to the whole body: a body of two tokens cut as one prompt
    of one token is malformed (a router's bug, or a body meant for another cut), not a
    prompt with its tail silently dropped and answered as if it were the whole."""
    two = np.array([1, 2], dtype="<u4").tobytes()
    assert len(run(probe.from_control({"model_id": "m", "tokens": two,
                                       "lengths": [1, 1]}))["results"]) == 2
    for lengths in ([1], [0, 1], [3]):
        with pytest.raises(ProtocolError, match="add up to"):
            run(probe.from_control({"model_id": "m", "tokens": two, "lengths": lengths}))


def test_more_prompts_than_the_cap_are_refused_before_they_are_cut() -> None:
    """``split_prompts`` bounds the batch itself (MAX_PROMPTS) before it makes a prompt
    per length: a long list of zero lengths would otherwise be cut into as many prompts
    before the probe's own count refused them."""
    assert len(split_prompts(b"", None, [0] * MAX_PROMPTS, 10)) == MAX_PROMPTS
    with pytest.raises(LimitExceeded, match="prompts in one request"):
        split_prompts(b"", None, [0] * (MAX_PROMPTS + 1), 10)


def test_a_prompt_of_more_keys_than_allowed_is_refused_before_it_is_split(
        probe: PrefixProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt of max_keys + 1 block keys, within the batch's budget: refused from the
    blob's length (daemon.max_context_tokens) before a key object is built, as the batch
    budget is; the probe's own per-prompt check would come only after the split."""
    max_keys = LIMITS.max_keys(16)
    assert len(split_prompts(None, b"k" * 16 * max_keys, None, max_keys)[0].keys or []) \
        == max_keys

    def no_split(raw: bytes) -> list[bytes]:
        raise AssertionError("keys split before the prompt's bound was checked")

    monkeypatch.setattr(TieredStore, "split_keys", staticmethod(no_split))
    with pytest.raises(LimitExceeded, match="keys in one prompt"):
        run(probe.from_control({"model_id": "m", "keys": b"k" * 16 * (max_keys + 1)}))


@pytest.mark.parametrize("raw", [b"x" * 15, b"x" * 17, "ab" * 15, "ab" * 17],
                         ids=["15-bytes", "17-bytes", "30-hex-digits", "34-hex-digits"])
def test_a_namespace_digest_of_another_length_is_a_protocol_error(probe: PrefixProbe,
                                                                  raw: object) -> None:
    """A namespace digest is 16 bytes: one of another length is a malformed request
    (ProtocolError: the caller's bug), not looked up and answered "unknown namespace" as
    if a namespace could have that digest."""
    with pytest.raises(ProtocolError, match="16-byte digest"):
        digest_of(raw)
    with pytest.raises(ProtocolError, match="16-byte digest"):
        run(probe.from_control({"ns": raw, "tokens": b""}))


@pytest.mark.parametrize("key", ["00" * 15, "00" * 17], ids=["15-bytes", "17-bytes"])
def test_a_json_block_key_of_another_length_is_refused(key: str) -> None:
    """JSON ``block_keys`` are 32 hex digits each: a shorter or longer one (valid hex) is
    a ProtocolError, not a key that no block can have walked as a miss."""
    assert json_prompt({"block_keys": ["00" * 16]}).keys == [bytes(16)]
    with pytest.raises(ProtocolError, match="16 bytes"):
        json_prompt({"block_keys": ["00" * 16, key]})


@pytest.mark.parametrize("ids", [[1.5, 2.0], [1.0, 2.0], [True, False]],
                         ids=["fractional", "whole-floats", "bools"])
def test_json_token_ids_that_are_not_ints_are_refused(ids: list[object]) -> None:
    """JSON ``token_ids`` must be ints: floats (even whole ones) or bools are refused at
    the wire, not passed on as a float array whose ids would be cast (1.5 read as 1, so two
    prompts sharing keys) or refused later by a check that is not this one's."""
    assert json_prompt({"token_ids": [1, 2]}).tokens is not None
    with pytest.raises(ProtocolError, match="flat list of ints"):
        json_prompt({"token_ids": ids})


@pytest.mark.parametrize(("body", "why"), [
    (b'{"model_id": "m", "token_ids": [NaN]}', "invalid character"),
    (b'{"model_id": "m", "token_ids": [1]} {}', "trailing characters"),
    ('{"model_id": "m", "token_ids": [1]}'.encode("utf-16"), "invalid character"),
    (b'{"model_id": "\\ud800", "token_ids": [1]}', "surrogate"),
    (b'{"model_id": "\xff", "token_ids": [1]}', "UTF-8"),
    (b"[" * 3000 + b"]" * 3000, "nested too deep"),
    (b'[{"model_id": "m", "token_ids": [1]}]', "a JSON object"),
], ids=["nan", "trailing", "utf-16", "lone-surrogate", "bad-utf-8", "deep", "not-an-object"])
def test_a_json_body_is_read_strictly_and_a_refusal_says_why(
        probe: PrefixProbe, body: bytes, why: str) -> None:
    """JSON bodies are read as RFC 8259 has them (UTF-8, no NaN, no lone surrogate):
    anything else is a ProtocolError naming the reason and where, not a guess and not a
    crash; the same prompt well formed is answered."""
    with pytest.raises(ProtocolError, match=why):
        run(probe.from_http(body, "application/json", {}))
    ok = json.dumps({"model_id": "m", "token_ids": list(range(16))}).encode()
    assert run(probe.from_http(ok, "application/json", {}))["prompt_blocks"] == 1


@given(body=st.binary(max_size=300) | st.text(alphabet=",[{:]} 0", max_size=300).map(
    str.encode))
def test_the_values_bound_counts_every_separator_and_opener(body: bytes) -> None:
    """The bound checked before a parse: one more than the commas, brackets, braces and
    colons (counted with numpy in one pass, not four ``bytes.count``)."""
    assert json_values(body) == sum(body.count(c) for c in (b",", b"[", b"{", b":")) + 1
