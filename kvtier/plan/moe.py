"""Mixture-of-experts shape read from a config.json: which layers are MoE, expert widths.

Families say it in their own fields, read as vLLM's model code reads them: DeepSeek leads
with ``first_k_dense_replace`` dense layers (then every ``moe_layer_freq``-th is MoE), Qwen
MoEs are MoE every ``decoder_sparse_step``-th layer except ``mlp_only_layers``, Llama-4
Maverick every ``interleave_moe_layer_step``-th (or the listed ``moe_layers``), Jamba every
``expert_layer_period``-th from ``expert_layer_offset``, and
Transformers 5 configs list ``mlp_layer_types``; the other layers have a dense MLP.
Shared experts, which every token passes through, are a count of expert-wide MLPs
(``n_shared_experts``) or one MLP of their own width (``shared_expert_intermediate_size``);
Llama-4 has one of ``intermediate_size`` that no field names. Counting every layer as
MoE, or dropping the shared experts, miscounts the weights by up to 2x (Maverick) or ~6%
(Qwen1.5-MoE, Llama-4 Scout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.plan.errors import PlanError
from kvtier.plan.fields import MAX_EXPERTS, MAX_LAYERS, brief, opt_int, require_int

#: Fields giving the shared experts' own MLP width (all of them fused into one MLP).
_SHARED_WIDTH = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                 "shared_intermediate_size")
#: Fields giving how many shared experts there are, each as wide as a routed expert.
_SHARED_COUNT = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
#: Model types whose MoE layers hold one shared expert no config field declares
#: (Transformers' and vLLM's Llama4 MoE: ``shared_expert`` of ``intermediate_size``).
IMPLICIT_SHARED_EXPERT = frozenset({"llama4", "llama4_text"})


@dataclass(frozen=True, slots=True)
class MoESpec:
    """Mixture-of-experts shape.

    ``expert_intermediate`` is one routed expert's MLP width; ``shared_intermediate`` the
    width of the shared experts fused into one MLP (0: none); ``moe_layers`` says per layer
    whether it is an MoE layer (the others have a dense MLP of the model's width).
    """

    routed_experts: int
    active_experts: int
    expert_intermediate: int
    shared_intermediate: int
    moe_layers: tuple[bool, ...]

    @property
    def dense_layers(self) -> int:
        """How many layers have a dense MLP instead of experts."""
        return self.moe_layers.count(False)


def _layer_list(cfg: dict[str, Any], key: str, layers: int, source: str) -> frozenset[int]:
    """A list of layer indices (``moe_layers``, ``mlp_only_layers``); empty when absent."""
    value = cfg.get(key)
    if value is None:
        return frozenset()
    if not isinstance(value, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
            for i in value):
        raise PlanError(f"{source}: config field {key!r} must be a list of layer indices "
                        f"from 0 to {layers - 1}, got {brief(value)}")
    return frozenset(value)


def moe_layer_mask(cfg: dict[str, Any], layers: int, source: str) -> tuple[bool, ...]:
    """Per layer, whether it is an MoE layer, by the rule of the family's fields."""
    kinds = cfg.get("mlp_layer_types")  # Transformers 5 spells it out per layer
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or any(
                k not in ("dense", "sparse") for k in kinds):
            raise PlanError(f"{source}: config field 'mlp_layer_types' must list 'dense' or "
                            f"'sparse' for each of the {layers} layers, got {brief(kinds)}")
        return tuple(k == "sparse" for k in kinds)
    if str(cfg.get("model_type", "")) == "jamba":  # JambaConfig.layers_num_experts
        period = opt_int(cfg, "expert_layer_period", source, 2, low=1, high=MAX_LAYERS)
        offset = opt_int(cfg, "expert_layer_offset", source, 1, high=MAX_LAYERS)
        return tuple(i % period == offset for i in range(layers))
    if cfg.get("moe_layers") is not None:  # Llama-4, when the config lists them
        listed = _layer_list(cfg, "moe_layers", layers, source)
        return tuple(i in listed for i in range(layers))
    step = (opt_int(cfg, "interleave_moe_layer_step", source, high=MAX_LAYERS)
            or opt_int(cfg, "decoder_sparse_step", source, 1, high=MAX_LAYERS))
    dense_only = _layer_list(cfg, "mlp_only_layers", layers, source)
    first_moe = opt_int(cfg, "first_k_dense_replace", source, high=layers)
    freq = opt_int(cfg, "moe_layer_freq", source, 1, high=MAX_LAYERS)
    return tuple(i not in dense_only and (i + 1) % step == 0 and i >= first_moe
                 and i % freq == 0 for i in range(layers))


def _shared_width(cfg: dict[str, Any], expert: int, source: str) -> int:
    """The shared experts' total MLP width (0 when there are none)."""
    for key in _SHARED_WIDTH:
        width = opt_int(cfg, key, source)
        if width:
            return width
    for key in _SHARED_COUNT:
        count = opt_int(cfg, key, source, high=MAX_EXPERTS)
        if count:
            return count * expert
    return expert if str(cfg.get("model_type", "")) in IMPLICIT_SHARED_EXPERT else 0


def read_moe(cfg: dict[str, Any], layers: int, source: str) -> MoESpec | None:
    """The MoE shape of a config, or None for a dense model (no routed experts)."""
    routed = (opt_int(cfg, "n_routed_experts", source, high=MAX_EXPERTS)
              or opt_int(cfg, "num_local_experts", source, high=MAX_EXPERTS)
              or opt_int(cfg, "num_experts", source, high=MAX_EXPERTS))
    if not routed:
        return None
    expert = opt_int(cfg, "moe_intermediate_size", source,
                     require_int(cfg, "intermediate_size", source))
    return MoESpec(
        routed_experts=routed,
        active_experts=opt_int(cfg, "num_experts_per_tok", source, 1, low=1, high=routed),
        expert_intermediate=expert,
        shared_intermediate=_shared_width(cfg, expert, source),
        moe_layers=moe_layer_mask(cfg, layers, source),
    )
