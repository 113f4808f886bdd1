"""Which weights a namespace's KV came from: a short fingerprint of the checkpoint that the
vLLM connector appends to the model id (``MODEL#w=FINGERPRINT``), so that KV computed by
other weights under the same name (a fine-tune or a new revision deployed at the same path,
a hub name pointing at a new commit) is a miss, never served.

What goes in: the checkpoint's ``config.json`` (a Mistral-format checkpoint's
``params.json``, which vLLM reads instead with ``config_format="mistral"``; a LoRA adapter's
``adapter_config.json``: the connector fingerprints adapters too) and, for every weight
file next to it, its
name, its size and eight 64 KiB windows spread over it; a safetensors file also gives its
header (every tensor's name, dtype, shape and place) and three 4 KiB windows inside each
tensor: its start, middle and end. A fine-tune that changes a few tensors only (a merged
LoRA on the attention projections, layers unfrozen one at a time) keeps every file's
size, header and most of its bytes, and eight windows per file missed 29 of 39 tensors
of a small model (found by review); a window in each tensor sees any change that spreads
over a tensor, at a cost of ~12 KiB read per tensor, not the whole checkpoint. Then the
engine's compute dtype, quantization and config overrides, which change the KV without
changing the files. Neither paths nor times go in:
identical copies of a checkpoint on two nodes (prefill and decode) give the same
fingerprint. A hub name is fingerprinted by name and the commit of its snapshot in the
Hugging Face cache (a commit names its files exactly, however much of them is downloaded
yet); a name with nothing cached, by name and revision.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["WEIGHTS_MARK", "base_model_id", "checkpoint_files", "code_digest", "fingerprint"]

log = logging.getLogger(__name__)

WEIGHTS_MARK = "#w="
"""Between a model id and its weights' fingerprint."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# a model's, a Mistral-format model's (its rope_theta, sizes: found left out by review), a
# LoRA adapter's
CONFIG_FILES = ("config.json", "params.json", "adapter_config.json")
WINDOWS = 8
WINDOW_BYTES = 64 << 10
TENSOR_WINDOW_BYTES = 4 << 10
MAX_SAFETENSORS_HEADER = 100 << 20   # the format's own limit on its JSON header


def base_model_id(model_id: str) -> str:
    """``model_id`` without a weights fingerprint (what a router names a model by)."""
    return model_id.split(WEIGHTS_MARK, 1)[0]


def checkpoint_files(model: str) -> list[Path] | None:
    """The files that identify a local checkpoint's weights (its config files first, then
    the weight files in name order), or None when ``model`` is not a local path."""
    path = Path(model).expanduser()
    if path.is_file():   # a single-file checkpoint (GGUF)
        return [path]
    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir()
                   if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
    configs = [path / name for name in CONFIG_FILES if (path / name).is_file()]
    return configs + files


MAX_CODE_FILES = 256


def code_digest(model: str) -> str | None:
    """A digest of the Python files beside a local checkpoint's config (its names and
    contents): the model code an engine runs with ``trust_remote_code``, which can change
    the KV the same weights compute; None when ``model`` is not a local directory."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    h = xxhash.xxh3_128()
    for f in sorted(p for p in path.iterdir() if p.suffix == ".py")[:MAX_CODE_FILES]:
        h.update(f"{f.name}:".encode())
        try:
            h.update(f.read_bytes())
        except OSError:
            h.update(b":unreadable:")
    return h.hexdigest()[:16]


def fingerprint(model: str, *, revision: str | None = None, dtype: object = None,
                quantization: object = None, overrides: Mapping[str, Any] | None = None
                ) -> str:
    """16 hex digits naming the weights of ``model`` (a directory, a file, or a hub name)
    and the settings that change the KV they compute (see the module docstring)."""
    h = xxhash.xxh3_128()
    files = checkpoint_files(model)
    if files is None:
        # a hub name: its snapshot's commit names the weights exactly (a snapshot never
        # changes), whatever part of it is downloaded yet: a process that reads it while
        # another still fills the cache (an interrupted download, a second engine starting)
        # agrees with the others
        snapshot = _cached_snapshot(model, revision)
        h.update(f"name:{model}@{snapshot.name if snapshot else revision or ''}".encode())
    for f in files or ():
        _hash_file(h, f)
    settings = [str(dtype).removeprefix("torch.") if dtype is not None else None,
                None if quantization is None else str(quantization),
                dict(overrides) if overrides else None]
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _hash_file(h: Any, path: Path) -> None:
    """Hash ``path``'s name, size and windows; a file that cannot be read (removed or
    unreadable since the listing) counts by its name, and never fails an engine's start."""
    try:
        _hash_windows(h, path)
    except OSError as exc:
        log.warning("weights fingerprint: %s not read (%s); counted by its name only",
                    path, exc.strerror or exc)
        h.update(f"{path.name}:unreadable:".encode())


def _hash_windows(h: Any, path: Path) -> None:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f"{path.name}:{size}:".encode())
        if size <= WINDOWS * WINDOW_BYTES:
            h.update(f.read())
            return
        step = (size - WINDOW_BYTES) // (WINDOWS - 1)
        for i in range(WINDOWS):
            f.seek(i * step)
            h.update(f.read(WINDOW_BYTES))
        if path.name.endswith(".safetensors"):
            _hash_tensors(h, f, size)


def _hash_tensors(h: Any, f: Any, size: int) -> None:
    """A safetensors file's header and a start, middle and end window of each tensor (a
    header that does not parse is hashed as it is: the file windows above still count)."""
    f.seek(0)
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 0 < n <= min(MAX_SAFETENSORS_HEADER, size - 8):
        return
    raw = f.read(n)
    h.update(raw)
    try:
        header = json.loads(raw)
        spans = sorted((int(t["data_offsets"][0]), int(t["data_offsets"][1]))
                       for name, t in header.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return
    base = 8 + n
    w = TENSOR_WINDOW_BYTES
    for lo, hi in spans:
        if not 0 <= lo <= hi <= size - base:
            continue
        if hi - lo <= 3 * w:
            windows = [(lo, hi)]
        else:
            mid = (lo + hi) // 2 - w // 2
            windows = [(lo, lo + w), (mid, mid + w), (hi - w, hi)]
        for a, b in windows:
            f.seek(base + a)
            h.update(f.read(b - a))


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The directory of ``repo_id``'s snapshot in the Hugging Face cache, if it is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:   # not a repo id (a missing local path), or a malformed cache
        return None
    return Path(found).parent if isinstance(found, str) else None
