"""The daemon's prefix-locality probe (``kvtier.prefix``) for routers.

One probe walks the prompt's block keys through the index the way ``TieredStore.lookup``
does, then asks Redis for the leading run it holds, and changes nothing: no promotion, no
prefetch, no eviction-order touch, no lookup counters, no namespace registration (a
namespace may be named by its registered digest, or spelled out and hashed here). Token
ids arrive as little-endian u4 bytes and are hashed through numpy views (the zero-copy path
of ``kvtier.keys.block_keys``); a JSON list of ints is accepted for convenience.

Bounds (``kvtier.daemon.limits``): a prompt carries at most ``max_context_tokens`` tokens
(or as many keys as that makes in blocks); a batch at most ``MAX_PROMPTS`` prompts and
``BATCH_CONTEXTS`` times ``max_context_tokens`` tokens in all (a key blob is checked against
it before it is split); a binary body at most what that budget takes (u4 tokens or 16-byte
keys). A JSON body is parsed on the event loop in one piece (msgspec's strict RFC 8259
decoder, half ``json.loads``'s time, then ``np.asarray``: ~0.04 ms per thousand values; a
thread would hold the GIL as long), so it carries at most ``JSON_MAX_TOKENS`` values and
``json_max_bytes`` bytes, both checked before it is parsed (values counted from its commas,
brackets, braces and colons): one parse stays within a few ms; large prompts go as
application/octet-stream.
The Redis part is bounded by ``redis.lookup_budget_s``, as a lookup's is. Reading a
request's wire forms (digests, token blobs, JSON prompts) is ``kvtier.daemon.prefix_input``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container, Mapping
from typing import Any

from kvtier.daemon.limits import Limits
from kvtier.daemon.prefix_input import (
    BATCH_CONTEXTS,
    MAX_PROMPTS,
    ModelIndex,
    PromptInput,
    digest_of,
    flag,
    json_body,
    json_prompt,
    json_values,
    layout_words,
    query_int,
    split_prompts,
    utf8_text,
)
from kvtier.errors import (
    LimitExceeded,
    ProtocolError,
    UnknownNamespace,
)
from kvtier.index import SlotState
from kvtier.keys import KEY_BYTES, MAX_NAME_CHARS, ROOT_KEY, BlockKey, Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.prefix import PrefixLocality, RedisProbe
from kvtier.protocol import optional_int
from kvtier.store import TieredStore
from kvtier.store.slices import CHECK_EVERY, Turn

KEY_PIECE = 512   # blocks hashed between two looks at the turn (kvtier.store.slices)
JSON_BYTES_PER_TOKEN = 8   # `151643, ` : a 6-digit token id as json.dumps writes it
JSON_CONTEXTS = 2          # full-length prompts one JSON body may carry (at most...)
JSON_MAX_TOKENS = 32768    # ...and token ids in all: ~3 ms of parse (loads + asarray)
JSON_SLACK = 64 * 2**10    # namespace fields, layouts, keys of a batch's objects
_OCTET = "application/octet-stream"
_MAX_TP = 1 << 16
_CPU_STATES = (SlotState.READY, SlotState.LOADING)
_NS_FIELDS = ("namespace", "model_id", "layout", "tp_rank", "tp_size", "cache_salt")



class PrefixProbe:
    """Answers prefix-locality questions against one store, within the daemon's limits."""

    def __init__(self, store: TieredStore, limits: Limits) -> None:
        self.store = store
        self.limits = limits
        self.models = ModelIndex(store)
        ctx = limits.max_context_tokens
        tokens = min(JSON_MAX_TOKENS, JSON_CONTEXTS * ctx)
        self.json_max_values = tokens + MAX_PROMPTS * 16
        self.json_max_bytes = JSON_BYTES_PER_TOKEN * tokens + JSON_SLACK
        self.octet_max_bytes = 4 * BATCH_CONTEXTS * ctx   # u4 tokens (keys take fewer)

    @property
    def max_body(self) -> int:
        """The most bytes any ``POST /v1/prefix`` body may hold."""
        return max(self.octet_max_bytes, self.json_max_bytes)

    # -- the probe -----------------------------------------------------------------------
    async def probe(self, ns: Namespace, keys: list[BlockKey], *,
                    redis: bool = True) -> PrefixLocality:
        """Leading blocks of ``keys`` cached for ``ns``: locally by tier, then in Redis."""
        digest, layout = ns.digest, ns.layout
        fp, nbytes = layout.fingerprint, layout.block_bytes
        get = self.store.index.get
        n_local = n_cpu = 0
        turn = Turn()
        # the walk of TieredStore.lookup, without its effects, CHECK_EVERY blocks between
        # two looks at the turn (a long prompt takes turns with the other clients); the
        # checks of BlockMeta.present inlined: ~0.15 us a block instead of ~0.55
        for lo in range(0, len(keys), CHECK_EVERY):
            if lo and turn.over():
                await turn.pause()
            for meta in map(get, keys[lo:lo + CHECK_EVERY]):
                if (meta is None or meta.namespace != digest or meta.layout_fp != fp
                        or meta.nbytes != nbytes):
                    break
                if meta.cpu_state in _CPU_STATES:
                    n_cpu += 1
                elif meta.nvme is None or not meta.nvme_ready:   # not present
                    break
                n_local += 1
            else:
                continue
            break
        state, from_zero, after_local = await self._redis(keys, n_local, digest, redis)
        return PrefixLocality(layout.tokens_per_block, len(keys), n_local + after_local,
                              n_local, {"cpu": n_cpu, "nvme": n_local - n_cpu}, state,
                              from_zero)

    async def _redis(self, keys: list[BlockKey], n_local: int, digest: bytes,
                     want: bool) -> tuple[RedisProbe, int, int]:
        """(state, leading blocks in Redis from block 0, leading blocks after the local
        prefix). The second, what a lookup adds, is probed first and alone, as a lookup
        probes it (``keys[n_local:]``); the head (``keys[:n_local]``) then, with what is left
        of ``redis.lookup_budget_s``. A timeout of the head leaves the tail's count."""
        tier = self.store.redis
        if not want:
            return RedisProbe.SKIPPED, 0, 0
        if tier is None:
            return RedisProbe.OFF, 0, 0
        if not tier.up:
            return RedisProbe.DOWN, 0, 0
        after = 0
        try:
            async with asyncio.timeout(self.store.redis_lookup_budget_s):
                if n_local < len(keys):
                    after = int(await tier.exists_prefix(keys[n_local:], namespace=digest))
                if n_local == 0:
                    return RedisProbe.OK, after, after
                head = int(await tier.exists_prefix(keys[:n_local], namespace=digest))
        except TimeoutError:
            return RedisProbe.TIMEOUT, 0, after
        return RedisProbe.OK, (head + after if head == n_local else head), after

    async def probe_many(self, items: list[tuple[Namespace, PromptInput]], *,
                         redis: bool = True) -> list[PrefixLocality]:
        """Probe a checked batch; the Redis probes run concurrently."""
        turn = Turn()
        keyed = [(ns, await self._keys(ns, p, turn)) for ns, p in items]
        if len(keyed) == 1:   # (no task to make and schedule: ~10 us of a router's probe)
            ns, keys = keyed[0]
            return [await self.probe(ns, keys, redis=redis)]
        return list(await asyncio.gather(*(self.probe(ns, keys, redis=redis)
                                           for ns, keys in keyed)))

    async def _keys(self, ns: Namespace, prompt: PromptInput, turn: Turn) -> list[BlockKey]:
        """The prompt's block keys, hashed ``KEY_PIECE`` blocks at a time between which the
        event loop may serve others (a batch can hold several 128k-token prompts)."""
        if prompt.keys is not None:
            return prompt.keys
        assert prompt.tokens is not None
        step = KEY_PIECE * ns.layout.tokens_per_block
        keys: list[BlockKey] = []
        for lo in range(0, max(1, len(prompt.tokens)), step):
            if turn.over():
                await turn.pause()
            try:
                keys += block_keys(ns, prompt.tokens[lo:lo + step],
                                   parent=keys[-1] if keys else ROOT_KEY)
            except ValueError as exc:
                raise ProtocolError(f"token ids: {exc}") from None
        return keys

    # -- namespaces ----------------------------------------------------------------------
    def namespace(self, spec: Mapping[str, Any],
                  known: Container[bytes] = ()) -> Namespace:
        """The namespace a request names: ``namespace`` (the registered digest, bytes or
        hex), or ``model_id`` with ``tp_rank``/``tp_size``/``cache_salt`` and either a
        ``layout`` (hashed here, registered or not) or none (then the one namespace
        registered with those fields).

        A digest names a namespace with a ``cache_salt`` only when it is in ``known`` (the
        caller registered it, with the salt): a digest alone proves nothing, and a probe
        would tell whether a tenant's prompt is cached. Elsewhere the salt is asked for."""
        raw = spec.get("namespace")
        if raw is not None:
            digest = digest_of(raw)
            entry = self.store.namespaces.get(digest)
            if entry is not None and entry.namespace.cache_salt is not None and \
                    digest not in known:
                entry = None
            if entry is None:
                raise UnknownNamespace("namespace not registered with this daemon, or salted: "
                                       "name it by model_id, layout and cache_salt instead "
                                       "(a digest names only a namespace without a salt)")
            return entry.namespace
        model_id = spec.get("model_id")
        if not isinstance(model_id, str) or not model_id or len(model_id) > MAX_NAME_CHARS:
            raise ProtocolError("name the namespace: 'namespace' (its digest) or 'model_id' "
                                f"(a string of at most {MAX_NAME_CHARS} characters)")
        salt = spec.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_NAME_CHARS):
            raise ProtocolError(f"cache_salt must be a string of at most {MAX_NAME_CHARS} "
                                "characters or null")
        utf8_text("model_id", model_id)
        utf8_text("cache_salt", salt or "")
        tp_size = optional_int(dict(spec), "tp_size", 1, 1, _MAX_TP)
        tp_rank = optional_int(dict(spec), "tp_rank", 0, 0, tp_size - 1)
        layout = spec.get("layout")
        # a model named without its weights fingerprint (kvtier.weights) matches the
        # registered namespaces of any weights of it
        if salt is None:
            found = self.store.namespaces_named(model_id, None, tp_rank, tp_size)
        else:
            # resolved against the model's namespaces of every salt, layout given or not
            # (found by review: with one, a right salt answered 400 for two weights, a
            # wrong one 200): the answer does not tell whether a salt is registered here
            found = [Namespace(ns.model_id, ns.layout, tp_rank, tp_size, salt)
                     for ns in self.models.named(model_id, tp_rank, tp_size)]
        if layout is not None:
            spelled = Namespace(model_id, KVLayout.from_dict(layout), tp_rank, tp_size, salt)
            found = [ns for ns in found
                     if ns.layout.fingerprint == spelled.layout.fingerprint]
            if not found or any(ns.digest == spelled.digest for ns in found):
                return spelled   # probed as spelled out, registered or not
        if not found:
            raise UnknownNamespace(f"no engine serving {model_id!r} (with this tp_rank and "
                                   "tp_size) has registered with this daemon: pass its "
                                   "layout to probe anyway")
        if len(found) > 1:
            what = sorted(f"{ns.model_id} ({layout_words(ns.layout)})" for ns in found)
            raise ProtocolError(f"{len(found)} namespaces of {model_id!r} are registered "
                                f"here ({', '.join(what)}): pass 'namespace', or the "
                                "'model_id' and 'layout' of one")
        return found[0]

    # -- bounds --------------------------------------------------------------------------
    def _check_prompt(self, ns: Namespace, prompt: PromptInput) -> int:
        """The prompt's size in tokens, refused beyond the daemon's per-request bound."""
        tpb = ns.layout.tokens_per_block
        if prompt.keys is not None:
            limit = self.limits.max_keys(tpb)
            if len(prompt.keys) > limit:
                raise LimitExceeded(f"{len(prompt.keys)} keys in one prompt; this namespace "
                                    f"allows {limit} (daemon.max_context_tokens "
                                    f"{self.limits.max_context_tokens} in blocks of {tpb})")
            return len(prompt.keys) * tpb
        assert prompt.tokens is not None
        n = int(prompt.tokens.shape[0])
        if n > self.limits.max_context_tokens:
            raise LimitExceeded(f"a prompt of {n} tokens; the daemon allows "
                                f"{self.limits.max_context_tokens} "
                                "(daemon.max_context_tokens)")
        return n

    def _check_batch(self, items: list[tuple[Namespace, PromptInput]]) -> None:
        if len(items) > MAX_PROMPTS:
            raise LimitExceeded(f"{len(items)} prompts in one request; at most {MAX_PROMPTS}: "
                                "split the batch")
        budget = BATCH_CONTEXTS * self.limits.max_context_tokens
        total = sum(self._check_prompt(ns, p) for ns, p in items)
        if total > budget:
            raise LimitExceeded(_over_batch(total, budget))

    # -- the control op ------------------------------------------------------------------
    async def from_control(self, msg: dict[str, Any],
                           known: Container[bytes] = ()) -> dict[str, Any]:
        """``prefix_locality``: ``ns`` (digest) or the namespace fields; ``tokens`` (u4
        little-endian bytes) or ``keys`` (16-byte keys, concatenated); ``lengths`` (tokens
        or keys per prompt) makes a batch; ``redis`` (default true). Answers ``results``."""
        spec = {k: msg[k] for k in _NS_FIELDS if k in msg}
        if "ns" in msg:
            spec["namespace"] = msg["ns"]
        ns = self.namespace(spec, known)
        prompts = self._split(ns, msg.get("tokens"), msg.get("keys"), msg.get("lengths"))
        items = [(ns, p) for p in prompts]
        self._check_batch(items)
        results = await self.probe_many(items, redis=flag(msg.get("redis", True)))
        return {"results": [r.to_dict() for r in results]}

    def _split(self, ns: Namespace, tokens: object, keys: object,
               lengths: object) -> list[PromptInput]:
        tpb = ns.layout.tokens_per_block
        return split_prompts(tokens, keys, lengths, self.limits.max_keys(tpb),
                             BATCH_CONTEXTS * self.limits.max_context_tokens // tpb)

    # -- HTTP ----------------------------------------------------------------------------
    def http_limit(self, content_type: str, query: Mapping[str, str],
                   declared: int | None) -> int:
        """What can be checked of a ``POST /v1/prefix`` before its body is read (a
        KVTierError otherwise): its content type; for a binary body its namespace (from the
        query), the batch budget of its ``lengths`` and its declared size against what they
        make (or one prompt's bound); for a JSON body its declared size. Answers the most
        body bytes to read: no valid body is larger."""
        if content_type == _OCTET:
            ns, as_keys, lengths, _ = self._octet_query(query)
            tpb = ns.layout.tokens_per_block
            unit = KEY_BYTES if as_keys else 4
            if lengths is not None:
                n = sum(lengths) * (tpb if as_keys else 1)
                budget = BATCH_CONTEXTS * self.limits.max_context_tokens
                if n > budget:
                    raise LimitExceeded(_over_batch(n, budget))
                limit = sum(lengths) * unit
            else:
                limit = unit * (self.limits.max_keys(tpb) if as_keys
                                else self.limits.max_context_tokens)
            if declared is not None and declared > limit:
                what = "16-byte keys" if as_keys else "u4 tokens"
                of = "?lengths=" if lengths is not None else "daemon.max_context_tokens"
                raise LimitExceeded(f"a body of {declared} bytes; this request carries at "
                                    f"most {limit} ({what}, from {of})")
            return limit
        if content_type not in ("application/json", ""):
            raise ProtocolError(f"unsupported content type {content_type[:64]!r}: send "
                                "application/json or application/octet-stream")
        if declared is not None and declared > self.json_max_bytes:
            raise LimitExceeded(self._json_too_large(f"{declared} bytes"))
        return self.json_max_bytes

    def _json_too_large(self, what: str) -> str:
        return (f"a JSON body of {what}; at most {self.json_max_bytes} bytes and "
                f"{self.json_max_values} values (a JSON body is parsed in one piece): send "
                "large prompts and batches as application/octet-stream (u4 tokens, or "
                "16-byte keys with ?input=keys, cut by ?lengths=)")

    def _octet_query(self, query: Mapping[str, str]
                     ) -> tuple[Namespace, bool, list[int] | None, bool]:
        spec: dict[str, Any] = dict(query)
        for name in ("tp_rank", "tp_size"):
            if name in spec:
                spec[name] = query_int(name, spec[name])
        ns = self.namespace(spec)
        as_keys = query.get("input", "tokens") == "keys"
        lengths = None
        if "lengths" in query:
            text = query["lengths"]
            if text.count(",") >= MAX_PROMPTS:
                raise LimitExceeded(f"{text.count(',') + 1} prompts in one request; at "
                                    f"most {MAX_PROMPTS}: split the batch")
            lengths = [query_int("lengths", x) for x in text.split(",")]
        want_redis = query.get("redis", "1").lower() not in ("0", "false", "no")
        return ns, as_keys, lengths, want_redis

    async def from_http(self, body: bytes, content_type: str,
                        query: Mapping[str, str]) -> dict[str, Any]:
        """``POST /v1/prefix``: JSON (``token_ids``, ``tokens_b64`` or ``block_keys``, or
        ``prompts`` for a batch), or ``application/octet-stream`` (u4 tokens or raw keys,
        with the namespace and ``lengths`` in the query string). One prompt answers the
        probe itself, a batch ``{"results": [...]}``."""
        if content_type == _OCTET:
            ns, as_keys, lengths, want_redis = self._octet_query(query)
            prompts = self._split(ns, None if as_keys else body, body if as_keys else None,
                                  lengths)
            items = [(ns, p) for p in prompts]
            batch = lengths is not None
        elif content_type in ("application/json", ""):
            if len(body) > self.json_max_bytes:
                raise LimitExceeded(self._json_too_large(f"{len(body)} bytes"))
            # a bound on the values, without parsing (found by review: commas alone missed
            # nesting; 320 KiB of `[[[...]]]` made 163k lists, 25-137 ms of event loop)
            values = json_values(body)
            if values > self.json_max_values:
                raise LimitExceeded(self._json_too_large(f"{values} values"))
            doc = json_body(body)
            items, batch = self._json_items(doc)
            want_redis = flag(doc.get("redis", True))
        else:
            raise ProtocolError(f"unsupported content type {content_type[:64]!r}: send "
                                "application/json or application/octet-stream")
        self._check_batch(items)
        results = [r.to_dict() for r in await self.probe_many(items, redis=want_redis)]
        return {"results": results} if batch else results[0]

    def _json_items(self, doc: dict[str, Any]) -> tuple[list[tuple[Namespace, PromptInput]],
                                                         bool]:
        top = {k: doc[k] for k in _NS_FIELDS if k in doc}
        prompts = doc.get("prompts")
        if prompts is None:
            return [(self.namespace(top), json_prompt(doc))], False
        if not isinstance(prompts, list):
            raise ProtocolError("'prompts' must be a list of objects")
        if len(prompts) > MAX_PROMPTS:
            raise LimitExceeded(f"{len(prompts)} prompts in one request; at most "
                                f"{MAX_PROMPTS}: split the batch")
        items = []
        for p in prompts:
            if not isinstance(p, dict):
                raise ProtocolError("each of 'prompts' must be an object")
            own = {k: p[k] for k in _NS_FIELDS if k in p}
            items.append((self.namespace({**top, **own}), json_prompt(p)))
        return items, True


def _over_batch(total: int, budget: int) -> str:
    return (f"{total} tokens in one batch; at most {budget} ({BATCH_CONTEXTS} x "
            "daemon.max_context_tokens): split it")

