"""A multimodal checkpoint's vision encoder and projector weights, estimated from its
``vision_config``: vLLM loads them on the GPU beside the language model, 3-8% of the
weights of Gemma-3, Qwen-VL, LLaVA, Mllama or InternVL, which the plan otherwise gives to
the KV.

The encoder is counted as a ViT (``num_hidden_layers`` or ``depth`` blocks, plus Mllama's
``num_global_layers``, of attention with biases and an MLP, gated where the activation is
SiLU or the encoder is Pixtral), its patch and position embeddings, and a projector from
the merged patches (``spatial_merge_size``, or InternVL's ``downsample_ratio``) to the
text width, with Qwen3-VL's deepstack mergers. Against Transformers' counts of nine
families' default configs the estimate is within 0.78-1.06 of the vision part, so within
about 1% of the whole model. An encoder not described as a ViT (Gemma-3n's MobileNet) is
not counted.
"""

from __future__ import annotations

from typing import Any

from kvtier.plan.fields import MAX_DIM, MAX_LAYERS, opt_int

_GATED_ACTS = frozenset({"silu", "swiglu"})
_GATED_TYPES = frozenset({"pixtral"})


def _first_int(value: object) -> object:
    """A square size given as ``[h, w]`` (InternVL) read as ``h``."""
    return value[0] if isinstance(value, list) and value else value


def vision_params(cfg: dict[str, Any], text_hidden: int, source: str) -> int:
    """Parameters of the vision encoder and projector a config declares (0: none)."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    v = {**vision, "patch_size": _first_int(vision.get("patch_size")),
         "image_size": _first_int(vision.get("image_size"))}
    label = "vision_config"
    hidden = opt_int(v, "hidden_size", source, label=f"{label}.hidden_size")
    if not hidden:
        return 0
    inner = opt_int(v, "intermediate_size", source, 4 * hidden,
                    label=f"{label}.intermediate_size")
    layers = (opt_int(v, "num_hidden_layers", source, high=MAX_LAYERS,
                      label=f"{label}.num_hidden_layers")
              or opt_int(v, "depth", source, high=MAX_LAYERS, label=f"{label}.depth"))
    if not layers:   # not a ViT (Gemma-3n's MobileNet in timm's fields): not counted
        return 0
    layers += opt_int(v, "num_global_layers", source, high=MAX_LAYERS,
                      label=f"{label}.num_global_layers")
    gated = str(v.get("hidden_act", "")) in _GATED_ACTS or str(
        v.get("model_type", "")) in _GATED_TYPES
    block = 4 * hidden * hidden + 4 * hidden            # Q, K, V, O and their biases
    block += (3 if gated else 2) * hidden * inner + inner + hidden + 4 * hidden  # MLP, norms
    patch = opt_int(v, "patch_size", source, 14, low=1, label=f"{label}.patch_size")
    channels = (opt_int(v, "num_channels", source, label=f"{label}.num_channels")
                or opt_int(v, "in_channels", source, 3, label=f"{label}.in_channels"))
    frames = opt_int(v, "temporal_patch_size", source, 1, label=f"{label}.temporal_patch_size")
    embed = channels * patch * patch * frames * hidden
    image = opt_int(v, "image_size", source, label=f"{label}.image_size")
    positions = opt_int(v, "num_position_embeddings", source, (image // patch) ** 2,
                        high=MAX_DIM, label=f"{label}.num_position_embeddings")
    merge = (opt_int(v, "spatial_merge_size", source, label=f"{label}.spatial_merge_size")
             or opt_int(cfg, "spatial_merge_size", source, 1)) ** 2
    ratio = cfg.get("downsample_ratio")
    if isinstance(ratio, int | float) and not isinstance(ratio, bool) and 0 < ratio <= 1:
        merge = round(1 / ratio ** 2)
    out = opt_int(v, "out_hidden_size", source, text_hidden,
                  label=f"{label}.out_hidden_size")
    deepstack = v.get("deepstack_visual_indexes")
    mergers = 1 + (len(deepstack) if isinstance(deepstack, list) else 0)
    projector = mergers * (hidden * merge * out + out * out)
    return layers * block + embed + positions * hidden + projector
