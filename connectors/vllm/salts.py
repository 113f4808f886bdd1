"""A request's namespace salt: the tenant's ``cache_salt``, the LoRA adapter that computed
its KV (name, path, id and a fingerprint of the adapter's weights) and the weights
generation of an engine whose weights were replaced in place, one to one, so that two
requests share KV only when all match; ``False`` for a request whose KV is not a function
of its token ids alone."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvtier.keys import name_refusal
from kvtier.lograte import LogRate
from kvtier.weights import checkpoint_files, fingerprint

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["adapter_fingerprint", "namespace_salt", "request_salt", "usable_salt"]

_log = logging.getLogger("kvtier.connectors.vllm")
_warn = LogRate(_log)


def request_salt(request: Request, generation: str | None = None
                 ) -> str | Literal[False] | None:
    """The namespace salt of a request, or ``False`` when its KV is not a function of its
    token ids alone (multimodal inputs, prompt embeddings, a LoRA adapter changed on disk
    since the process read it) and must not be cached, or when the daemon cannot take its
    salt (``usable_salt``).

    A LoRA adapter changes the KV, so it joins the tenant's ``cache_salt``, and so does the
    engine's weights ``generation`` (``namespace_salt``).
    """
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) \
            is not None:
        return False
    lora = getattr(request, "lora_request", None)
    adapter = None
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or "")
        lora_id = int(getattr(lora, "lora_int_id", 0) or 0)
        weights = adapter_fingerprint(path, lora_id)
        if weights is None:   # changed in place: which version vLLM runs is unknown
            return False
        adapter = (str(getattr(lora, "lora_name", "")), path, lora_id, weights)
    tenant = getattr(request, "cache_salt", None)
    if tenant is not None and not isinstance(tenant, str):   # (offline API misuse)
        return False
    salt = namespace_salt(tenant, adapter, generation)
    return salt if salt is None or usable_salt(salt) else False


def usable_salt(salt: str) -> bool:
    """Whether the daemon can register a namespace with ``salt``: at most
    ``MAX_NAME_CHARS`` characters (an adapter's path counts) and valid Unicode. A request
    with another salt is not cached (vLLM serves it as it would without kvtier): a lone
    surrogate raised out of the scheduler and stopped the engine for good, and a salt over
    the limit cost the worker its connection (found by review). Said once per 10 s."""
    reason = name_refusal(salt)
    if reason is None:
        return True
    _warn.warning("salt", "kvtier: a request whose cache_salt is %s is not cached", reason)
    return False


@dataclass(slots=True)
class _Adapter:
    """What this process read of an adapter: its fingerprint, and its files as they were
    (name, size, inode, modification and change times) to see them replaced in place."""

    fingerprint: str
    files: tuple[tuple[str, int, int, int, int], ...]
    changed: bool = False


_ADAPTER_FINGERPRINTS: dict[tuple[str, int], _Adapter] = {}
MAX_ADAPTER_FINGERPRINTS = 4096


def _files_now(path: str) -> tuple[tuple[str, int, int, int, int], ...]:
    """The adapter's files as they are (a listing and a stat each: ~40 us a request)."""
    found = []
    for f in checkpoint_files(path) or ():
        try:
            st = f.stat()
        except OSError:
            found.append((f.name, -1, 0, 0, 0))
            continue
        found.append((f.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(found)


def adapter_fingerprint(path: str, lora_id: int) -> str | None:
    """The weights fingerprint of a LoRA adapter (``kvtier.weights``: its config and
    sampled weight windows), read once per adapter per process: an adapter retrained and
    deployed under the same name and path must not be served the old one's KV.

    None once its files changed in place since this process read them: vLLM keeps an
    adapter it loaded until its LRU cache drops it, then reads the files again, so the
    engine may run either version and nothing tells which. Its requests are then neither
    loaded nor saved for the rest of the process (found by review: after a reload the old
    KV was served to the new adapter). Deploy a retrained adapter under a new id or path."""
    if not path:
        return ""
    key = (path, lora_id)
    now = _files_now(path)
    known = _ADAPTER_FINGERPRINTS.get(key)
    if known is None:
        if len(_ADAPTER_FINGERPRINTS) >= MAX_ADAPTER_FINGERPRINTS:
            _ADAPTER_FINGERPRINTS.clear()
        known = _ADAPTER_FINGERPRINTS[key] = _Adapter(fingerprint(path), now)
    elif not known.changed and now != known.files:
        known.changed = True
        _log.warning("kvtier: LoRA adapter %s (id %d) changed on disk since this engine "
                     "first read it: its requests are no longer cached by kvtier in this "
                     "process (deploy a retrained adapter under a new id or path)",
                     path, lora_id)
    return None if known.changed else known.fingerprint


_RESERVED = "\x1f"   # opens every salt this connector derives; a tenant's is escaped


def namespace_salt(cache_salt: str | None, adapter: tuple[str, str, int, str] | None,
                   generation: str | None = None) -> str | None:
    """The namespace salt of a tenant's ``cache_salt``, LoRA ``adapter`` (name, path, id,
    weights fingerprint) and weights ``generation`` (set once an engine's weights were
    replaced in place, ``SchedulerSide.reset_cache``), one to one: two requests share KV
    only when all are equal. Without an adapter or a generation the tenant's salt is kept
    as is (its namespace, and what it stored, stay the same), unless it begins with the
    reserved character; otherwise they are JSON under that character, so no tenant can
    choose a salt that names another tenant's adapter or generation namespace."""
    if generation is not None:
        return f"{_RESERVED}gen:" + json.dumps([generation, cache_salt, adapter],
                                               ensure_ascii=True)
    if adapter is None:
        if cache_salt is not None and cache_salt.startswith(_RESERVED):
            return f"{_RESERVED}salt:{cache_salt}"
        return cache_salt
    return f"{_RESERVED}lora:" + json.dumps([cache_salt, *adapter], ensure_ascii=True)
