"""The weights fingerprint of a vLLM engine: what the connector appends to its model id
(``MODEL#w=FINGERPRINT``) so that KV computed by other weights, or by the same weights
computing other KV, is a miss, never served (docs/vllm-connector.md, "Weights")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.weights import code_digest, fingerprint

from .overrides import callable_digest, plain_value

# vLLM's load formats that read the weights from the checkpoint's own files, which the
# fingerprint hashes; any other (dummy, tensorizer, ipc_cache, modelexpress, a plugin's)
# takes them from elsewhere, and joins the fingerprint with its loader settings
FILE_LOAD_FORMATS = frozenset({
    "auto", "hf", "safetensors", "pt", "npcache", "fastsafetensors", "instanttensor",
    "mistral", "gguf", "bitsandbytes", "runai_streamer", "runai_streamer_sharded",
    "sharded_state"})


def engine_fingerprint(model: Any, speculative: Any = None, cache: Any = None,
                       load: Any = None) -> str:
    """The weights fingerprint of a vLLM ``ModelConfig``: its checkpoint, revision, dtype,
    quantization and ``hf_overrides`` (a callable override counts by its name and what it
    does: ``overrides.callable_digest``); with a
    draft model (``speculative``), its fingerprint too: a draft's layers share the engine's
    KV pages, so its weights decide part of every block.

    Also what else changes the KV the same weights compute (each found giving wrong tokens
    when left out): the KV cache dtype of ``cache`` (every fp8 variant is stored as uint8,
    so the layout cannot tell e4m3 from e5m2), a config given apart from the checkpoint
    (``hf_config_path``), and for LongRoPE models (Phi-3/3.5, Phi-4-mini) whether
    ``max_model_len`` selects the long factors for every token; and of ``load`` (vLLM's
    ``LoadConfig``), a load format that does not read the checkpoint's files: an engine
    started with ``load_format="dummy"`` (random weights, for benchmarks) saved KV that
    engines serving the real checkpoint loaded (found by review); and the settings that
    load other weights or model code from the same files (``_loaded_otherwise``)."""
    overrides = model.hf_overrides
    if callable(overrides):
        # by what it does, not its name alone (overrides.py)
        overrides = {"callable": getattr(overrides, "__qualname__", type(overrides).__name__),
                     "kvtier.code": callable_digest(overrides)}
    settings = dict(overrides) if isinstance(overrides, Mapping) else {}
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and getattr(draft, "model", None):
        settings["kvtier.draft"] = [str(getattr(speculative, "method", None)),
                                    engine_fingerprint(draft)]
    cache_dtype = str(getattr(cache, "cache_dtype", None) or "auto")
    if cache_dtype != "auto":
        settings["kvtier.kv_cache_dtype"] = cache_dtype
    config_path = getattr(model, "hf_config_path", None)
    if config_path and str(config_path) != str(model.model):
        settings["kvtier.hf_config"] = fingerprint(str(config_path))
    load_format = str(getattr(load, "load_format", None) or "auto").lower()
    if load_format not in FILE_LOAD_FORMATS:
        settings["kvtier.load"] = [load_format, plain_value(getattr(
            load, "model_loader_extra_config", None)), _device_type()]
    settings.update(_loaded_otherwise(model))
    long_rope = _long_rope(model)
    if long_rope is not None:
        settings["kvtier.long_rope"] = long_rope
    return fingerprint(str(model.model), revision=model.revision, dtype=model.dtype,
                       quantization=model.quantization, overrides=settings or None)


def _loaded_otherwise(model: Any) -> dict[str, Any]:
    """What of a ``ModelConfig`` makes other weights or other model code of the same
    checkpoint files, when set (read from vLLM's ``ModelConfig`` in review, not run on
    this CPU build; each changes the KV with no change to the files hashed): weights
    streamed from elsewhere (``model_weights``, the object store URI of a runai checkpoint
    whose local directory holds its config only), online quantization's settings
    (``quantization_config``: which layers, which scheme), another model class
    (``model_class_overrides``) and, with ``trust_remote_code``, the model's own Python
    files and ``code_revision``."""
    out: dict[str, Any] = {}
    uri = getattr(model, "model_weights", None)
    if uri and str(uri) != str(model.model):
        out["kvtier.model_weights"] = str(uri)
    quant = getattr(model, "quantization_config", None)
    if quant is not None:
        out["kvtier.quantization_config"] = plain_value(quant)
    classes = getattr(model, "model_class_overrides", None)
    if classes:
        out["kvtier.model_classes"] = plain_value(classes)
    if getattr(model, "trust_remote_code", False):
        out["kvtier.remote_code"] = [code_digest(str(model.model)),
                                     getattr(model, "code_revision", None)]
    return out


def _device_type() -> str:
    """The platform's device type: dummy weights are drawn from a seeded generator of the
    device they live on, so another kind of device draws other weights."""
    try:
        from vllm.platforms import current_platform
    except ImportError:   # (no vLLM: unit tests of the fingerprint alone)
        return "unknown"
    return str(getattr(current_platform, "device_type", "unknown"))


def _long_rope(model: Any) -> bool | str | None:
    """For a LongRoPE model, whether vLLM uses the long factors (``max_model_len`` beyond
    the original context): the rotary embedding of every token, so the KV, depends on it.
    ``"unknown"`` when the lengths cannot be read; None for any other rope."""
    cfg = getattr(model, "hf_text_config", None)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, Mapping) or \
            params.get("rope_type", params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings",
                          getattr(cfg, "original_max_position_embeddings", None))
    max_len = getattr(model, "max_model_len", None)
    if not isinstance(original, int) or not isinstance(max_len, int):
        # undecidable here: a namespace of its own, neither the long factors' nor the
        # short ones' (True shared the long factors' namespace: found by review)
        return "unknown"
    return max_len > original
