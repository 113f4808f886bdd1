"""ModelSpec: what the planner needs to know about a model, read from a config.json.

A spec is built from the fields of a Hugging Face ``config.json`` (a user's file or a
built-in preset, which is stored in the same form), so both paths give the same numbers.
It records the attention kind (MHA, GQA/MQA, MLA), which layers use a sliding window,
enough of the architecture to count parameters, and how the weights are quantized.
Older configs' own spellings (GPT-2's ``n_layer``, MPT's ``d_model``, Falcon's
``multi_query``) are read as Transformers reads them (kvtier.plan.fields, .families).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier import jsonin
from kvtier.files import TooLarge, read_regular
from kvtier.plan.blocks import FULL, Block, read_blocks
from kvtier.plan.defaults import TEXT_TYPE, with_class_defaults
from kvtier.plan.errors import PlanError
from kvtier.plan.families import (
    attention_output_gate,
    gated_mlp,
    kv_heads,
    mlp_width,
    tied_embeddings,
)
from kvtier.plan.fields import MAX_CONTEXT, MAX_DIM, MAX_LAYERS, key_of, opt_int, require_int
from kvtier.plan.indexer import index_head_dim, indexer_layers
from kvtier.plan.layers import NO_KV, LayerReach, layer_reach, layer_types
from kvtier.plan.mixers import MLP_BLOCKS, LayerMixers, read_mixers
from kvtier.plan.moe import MoESpec, read_moe
from kvtier.plan.presets import find_preset, preset_names
from kvtier.plan.quant import Quantization, kv_cache_dtype, read_quantization
from kvtier.plan.shapes import MLA_ROPE_DEFAULT, Shape, expanded_head_dim, is_mla, layer_shapes
from kvtier.plan.side_weights import NO_SIDE_WEIGHTS, SideWeights, read_side_weights
from kvtier.plan.vision import vision_params
from kvtier.statsdoc import clean

MAX_CONFIG_BYTES = 64 << 20
"""Largest model config.json read (64 MiB): real ones are a few KiB."""
PURE_SSM = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})
"""Model types without attention (vLLM's MambaModelArchConfigConvertor and kin)."""
PREFIX_LM = frozenset({"hrm_text"})
"""Model types vLLM runs with the prompt attending both ways (``PrefillPrefixLMAttention``),
whatever their config says."""


class AttentionKind(str, Enum):
    """How a layer's KV is shaped: separate K and V per KV head, or one MLA latent."""

    MHA = "mha"  # one KV head per attention head
    GQA = "gqa"  # fewer KV heads than attention heads (MQA when there is one)
    MLA = "mla"  # DeepSeek: compressed latent + decoupled rope key, no separate K and V


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model geometry the KV and weights arithmetic reads.

    ``layer_windows`` holds, per layer, how many tokens of KV it keeps at most: ``None``
    for full attention, a window (sliding or chunked attention), or ``NO_KV`` (0) for a
    layer without attention KV (kvtier.plan.layers); ``state_layers`` of them carry a
    fixed-size recurrent state per sequence instead (linear attention, SSM, convolution).
    ``vocab_size`` is 0 when no config gives it: the KV can be planned, the weights need
    ``--params``. ``blocks`` holds a DeciLM stack's layers (kvtier.plan.blocks), whose
    parameters are counted per layer. ``indexer_layers`` mark the layers that also keep a
    sparse-attention indexer's key cache (DeepSeek-V3.2, kvtier.plan.indexer).
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    torch_dtype: str
    tie_embeddings: bool
    attention: AttentionKind
    layer_windows: tuple[int | None, ...]
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    moe: MoESpec | None = None
    attention_bias: bool = False
    quantization: Quantization | None = None
    state_layers: int = 0
    gated_mlp: bool = True  # gate, up and down matrices (Llama); False: up and down (GPT-2)
    attn_output_gate: bool = False  # a per-head output gate projected beside Q (Qwen3-Next)
    blocks: tuple[Block, ...] = ()
    index_head_dim: int = 0  # DeepSeek-V3.2's indexer key (kvtier.plan.indexer); 0: none
    indexer_layers: tuple[bool, ...] = ()  # per layer, whether it holds an indexer cache
    chunked_local_attention: bool = False  # attention_chunk_size set (Llama 4), as vLLM reads it
    layer_shapes: tuple[Shape, ...] = ()  # per layer (KV heads, head size); (): all alike
    checkpoint_kv_dtype: str = ""  # the KV dtype quantization_config asks vLLM for; "": none
    shared_kv_layers: int = 0  # last layers reading an earlier layer's KV (NO_KV above)
    side: SideWeights = NO_SIDE_WEIGHTS  # per-layer embeddings, AltUp, LAuReL (Gemma-3n/4)
    mixers: LayerMixers | None = None  # hybrid stacks' per-layer blocks; None: attention + MLP

    @property
    def windowed_layers(self) -> int:
        """How many layers keep a bounded window of KV (sliding or chunked attention)."""
        return sum(1 for w in self.layer_windows if w is not None and w != NO_KV)

    @property
    def sparse_mla(self) -> bool:
        """DeepSeek-V3.2-style sparse MLA (``index_topk``): every layer, indexed or not."""
        return self.attention is AttentionKind.MLA and self.index_head_dim > 0

    @property
    def kv_layers(self) -> int:
        """How many layers hold attention KV at all."""
        return sum(1 for w in self.layer_windows if w != NO_KV)

    def shape(self, layer: int) -> Shape:
        """Layer ``layer``'s (KV heads, head size) (MHA/GQA; an MLA latent is one)."""
        return self.layer_shapes[layer] if self.layer_shapes else (self.num_kv_heads,
                                                                   self.head_dim)

    @property
    def uniform_pages(self) -> bool:
        """Whether every KV layer's page has the same size, as vLLM's single KV cache group
        of one spec needs (Gemma-4's global layers do not)."""
        return len({self.shape(i) for i, w in enumerate(self.layer_windows)
                    if w != NO_KV}) <= 1


def _unwrap(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields of a multimodal config (``text_config``), with what
    only the outer config gives: the dtype, the vocabulary and the quantization."""
    if not isinstance(cfg.get("text_config"), dict) or key_of(cfg, "num_hidden_layers") in cfg:
        return cfg
    inner = dict(cfg["text_config"])
    if inner.get("model_type") is None and cfg.get("model_type") is not None:
        outer = str(cfg["model_type"])
        inner["model_type"] = TEXT_TYPE.get(outer, outer)
    if inner.get("torch_dtype") is None and inner.get("dtype") is None:
        inner["torch_dtype"] = cfg.get("torch_dtype") or cfg.get("dtype")
    for key in ("vocab_size", "quantization_config"):
        if inner.get(key) is None and cfg.get(key) is not None:
            inner[key] = cfg[key]   # (else left out: a class default may fill it)
    return inner


def _default_head_dim(cfg: dict[str, Any], hidden: int, heads: int, source: str) -> int:
    """The head size without ``head_dim``: ``hidden_size_per_head`` or hidden / heads, but
    Zamba2's attention runs on the hidden state concatenated with the embeddings (vLLM
    reads ``attention_head_dim``, which Zamba2Config makes 2 x hidden / heads)."""
    if str(cfg.get("model_type", "")) == "zamba2":
        return opt_int(cfg, "attention_head_dim", source, 2 * hidden // heads, low=1)
    # PLaMo 2 names it hidden_size_per_head (vLLM's get_head_size reads it next)
    return opt_int(cfg, "hidden_size_per_head", source, hidden // heads, low=1)


def _side_weights(outer: dict[str, Any], cfg: dict[str, Any], layers: int, hidden: int,
                  source: str) -> SideWeights:
    """The language model's weights beside its layers, and a multimodal checkpoint's
    vision encoder (kvtier.plan.vision), which only the outer config describes."""
    side = read_side_weights(cfg, layers, hidden, source)
    vision = vision_params(outer, hidden, source)
    return replace(side, dense=side.dense + vision) if vision else side


def _layer_count(cfg: dict[str, Any], source: str) -> int:
    """``num_hidden_layers``, or the length of the per-layer pattern where Transformers 5
    derives the count from it and config.json leaves it out (Nemotron-H); LongCat-Flash's
    attention sublayers."""
    if cfg.get("model_type") == "longcat_flash" and cfg.get("num_layers") is not None:
        # two attention sublayers per decoder layer, each its own KV in vLLM (Transformers
        # derives num_hidden_layers = 2 x num_layers): counted as layers of their own
        return 2 * require_int(cfg, "num_layers", source, MAX_LAYERS // 2)
    key = key_of(cfg, "num_hidden_layers")
    if cfg.get(key) is None:
        for field in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
            pattern = cfg.get(field)
            if isinstance(pattern, list | str) and 0 < len(pattern) <= MAX_LAYERS:
                return len(pattern)
    return require_int(cfg, key, source, MAX_LAYERS)


def _prefix_lm(cfg: dict[str, Any]) -> bool:
    """A model whose prompt tokens attend to the ones after them: ``PREFIX_LM`` or
    ``prefix_lm`` set (top level or in MPT's ``attn_config``)."""
    attn = cfg.get("attn_config")
    return (str(cfg.get("model_type", "")) in PREFIX_LM or cfg.get("prefix_lm") is True
            or (isinstance(attn, dict) and attn.get("prefix_lm") is True))


def spec_from_config(cfg: dict[str, Any], name: str = "") -> ModelSpec:
    """Build a ModelSpec from the fields of a Hugging Face config.json.

    Multimodal configs that nest the language model under ``text_config`` are unwrapped.
    Raises PlanError naming the missing or malformed field.
    """
    if not isinstance(cfg, dict):
        raise PlanError(f"{name or 'config'}: expected a JSON object, got {type(cfg).__name__}")
    outer = cfg
    cfg = with_class_defaults(_unwrap(cfg))
    source = name or str(cfg.get("_name_or_path") or "config.json")
    layers = _layer_count(cfg, source)
    hidden = require_int(cfg, key_of(cfg, "hidden_size"), source)
    if str(cfg.get("model_type", "")) in PURE_SSM:
        raise PlanError(f"{source}: a {cfg['model_type']} model has no attention layers: its "
                        "state per sequence has a fixed size and no KV grows with the "
                        "context, so there is no KV for kvtier to plan or offload")
    if _prefix_lm(cfg):
        raise PlanError(f"{source}: a prefix-LM model (its prompt attends both ways): a "
                        "token's KV depends on the whole prompt, not on the tokens before it, "
                        "so vLLM turns prefix caching off for it and kvtier's connector "
                        "refuses it; there is no reusable KV to plan")
    if cfg.get("compress_ratios") is not None or cfg.get("compress_rates") is not None:
        raise PlanError(f"{source}: compressed sparse attention (DeepSeek-V4: "
                        "compress_ratios) keeps a KV per layer that kvtier plan does not "
                        "model; it is not planned rather than planned wrong")
    heads = require_int(cfg, key_of(cfg, "num_attention_heads"), source)
    stack = read_blocks(cfg, layers, heads, hidden, source)
    kv = stack.kv_heads if stack else kv_heads(cfg, heads, source)
    expanded = expanded_head_dim(cfg, source)
    if expanded:  # MLA projections served as plain attention (MiniCPM3): a K/V per head
        kv, head_dim = heads, expanded
    else:
        head_dim = opt_int(cfg, "head_dim", source, _default_head_dim(cfg, hidden, heads, source),
                           low=1)
    if head_dim < 1:
        raise PlanError(f"{source}: hidden_size={hidden} is smaller than "
                        f"num_attention_heads={heads}; the config must give head_dim")
    kv_lora = opt_int(cfg, "kv_lora_rank", source)
    if is_mla(cfg) and kv_lora:
        attention = AttentionKind.MLA
    elif kv == heads:
        attention = AttentionKind.MHA
    else:
        attention = AttentionKind.GQA
    if attention is not AttentionKind.MLA and heads % kv:
        raise PlanError(f"{source}: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv}")
    _check_widths(source, heads * head_dim, 2 * kv * head_dim)
    moe = read_moe(cfg, layers, source)
    types = None if stack else layer_types(cfg, layers, source)
    mixers = read_mixers(cfg, types, hidden, source)
    if moe is not None and types is not None and any(t in MLP_BLOCKS for t in types):
        # one block per layer (Nemotron-H): the MoE layers are the ones the pattern names
        moe = replace(moe, moe_layers=tuple(t in ("moe", "sparse") for t in types))
    reach = (LayerReach(tuple(None if b.attention == FULL else NO_KV for b in stack.blocks), 0)
             if stack else layer_reach(cfg, layers, source))
    shared = opt_int(cfg, "num_kv_shared_layers", source, high=layers)
    if shared:   # the last layers read an earlier layer's KV (Gemma-3n): none of their own
        reach = LayerReach(reach.reach[:layers - shared] + (NO_KV,) * shared,
                           reach.state_layers)
    if reach.reach.count(NO_KV) == layers:
        raise PlanError(f"{source}: no layer holds attention KV (every layer is linear "
                        "attention, SSM, convolution or MLP): there is no KV to plan")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    model_type = str(cfg.get("model_type", ""))
    rope = opt_int(cfg, "qk_rope_head_dim", source)
    if attention is AttentionKind.MLA and not rope:
        rope = MLA_ROPE_DEFAULT  # every MLA config class's default
    shapes = () if stack or attention is AttentionKind.MLA else layer_shapes(
        cfg, layers, (kv, head_dim), source)
    for shape_kv, shape_dim in set(shapes):
        _check_widths(source, heads * shape_dim, 2 * shape_kv * shape_dim)
    return ModelSpec(
        name=source,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=mlp_width(cfg, hidden, source),
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=opt_int(cfg, key_of(cfg, "vocab_size"), source),
        max_context=opt_int(cfg, key_of(cfg, "max_position_embeddings"), source,
                            high=MAX_CONTEXT),
        torch_dtype=dtype,
        tie_embeddings=tied_embeddings(cfg, source),
        attention=attention,
        layer_windows=reach.reach,
        state_layers=reach.state_layers,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        q_lora_rank=opt_int(cfg, "q_lora_rank", source),
        qk_nope_head_dim=opt_int(cfg, "qk_nope_head_dim", source),
        v_head_dim=opt_int(cfg, "v_head_dim", source),
        moe=moe,
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        quantization=read_quantization(cfg, source),
        gated_mlp=gated_mlp(model_type),
        attn_output_gate=attention_output_gate(cfg, source),
        blocks=stack.blocks if stack else (),
        index_head_dim=index_head_dim(cfg, source),
        indexer_layers=indexer_layers(cfg, layers, source),
        chunked_local_attention=cfg.get("attention_chunk_size") is not None,
        layer_shapes=shapes,
        checkpoint_kv_dtype=kv_cache_dtype(cfg),
        shared_kv_layers=shared,
        side=_side_weights(outer, cfg, layers, hidden, source),
        mixers=mixers,
    )


def _check_widths(source: str, q_width: int, kv_width: int) -> None:
    """Refuse a query or KV width past MAX_DIM (2^24) values per token and layer: no model
    is that wide, and such a config planned 86 TB of KV per token (found by review)."""
    if max(q_width, kv_width) > MAX_DIM:
        raise PlanError(f"{source}: attention {q_width:,} query and {kv_width:,} KV values "
                        f"per token and layer is past {MAX_DIM:,}: not a real model's config")


def load_model(ref: str) -> ModelSpec:
    """Resolve ``--model``: a preset name, a config.json path, or a folder holding one."""
    fields = find_preset(ref)
    if fields is not None:
        return spec_from_config(fields, name=ref.strip().lower())
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"unknown model {ref!r}: not a preset and no config.json there; "
                        f"presets: {', '.join(preset_names())}")
    try:   # at most MAX_CONFIG_BYTES: a 1.5 GB file took 3 GB of memory (found by review)
        cfg = jsonin.loads(read_regular(path, MAX_CONFIG_BYTES))
    except TooLarge:
        raise PlanError(f"model config {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: "
                        "not a config.json") from None
    except (OSError, ValueError) as exc:   # (UnicodeDecodeError is a ValueError)
        raise PlanError(f"cannot read model config {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"model config {path}: expected a JSON object, got a JSON "
                        f"{type(cfg).__name__}")
    # made safe for a terminal, at most 200 characters (found by review: ESC reached it)
    return spec_from_config(cfg, name=clean(str(cfg.get("_name_or_path") or path), 200))
