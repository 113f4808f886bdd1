"""What older architectures' configs mean where the Llama-style fields are absent.

Falcon, GPT-BigCode and MPT say how many KV heads they have in their own fields
(``multi_query``, ``new_decoder_architecture``, ``num_kv_heads``, ``attn_config``); read as
``num_attention_heads`` KV heads, Falcon-7B's single KV head plans 71x its KV. Their MLPs,
like GPT-2's, OPT's and BLOOM's, are two matrices (up, down) where Llama's gated MLP has
three, and several tie the LM head to the embeddings by default. Only rules Transformers
and vLLM agree on are here; where a config leaves the meaning open, the plan refuses it.
"""

from __future__ import annotations

from typing import Any

from kvtier.plan.errors import PlanError
from kvtier.plan.fields import MAX_DIM, brief, flag, int_field, opt_int, require_int

FALCON = frozenset({"falcon", "RefinedWeb", "RefinedWebModel"})
"""Falcon and its legacy (trust_remote_code) RefinedWeb model types."""
TWO_MATRIX_MLP = frozenset(FALCON | {"gpt2", "gpt_bigcode", "gptj", "gpt_neo", "gpt_neox",
                                     "mpt", "opt", "bloom", "phi", "starcoder2", "apertus",
                                     "arcee", "persimmon", "nanochat", "jais2", "biogpt",
                                     "codegen", "nemotron_h"})
"""Model types whose MLP is up and down projections only (not gated)."""
TIED_BY_DEFAULT = frozenset(FALCON | {"gpt2", "gpt_bigcode", "gpt_neo", "mpt", "opt",
                                      "bloom", "gemma", "gemma2", "gemma3", "gemma3_text"})
"""Model types whose config class ties the LM head to the embeddings unless told not to."""
GATED_ATTENTION_OUTPUT = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                    "qwen3_5_moe_text"})
"""Model types whose full-attention layers gate their output per head (vLLM's
``Qwen3NextAttention``: a Q projection twice as wide) unless ``attn_output_gate`` is false."""
_KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num",
            "num_attention_groups")
"""Fields giving the KV heads, as vLLM's ``get_total_num_kv_heads`` reads them (ChatGLM's
``multi_query_group_num``, Step's ``num_attention_groups``)."""
_MPT_KV = {"multihead_attention": None, "multiquery_attention": 1}
_MAX_RATIO = 1000.0


def kv_heads(cfg: dict[str, Any], heads: int, source: str) -> int:
    """KV heads per layer: ``num_key_value_heads`` (or ``num_kv_heads`` / ``n_head_kv``),
    with each family's own rule first.

    Falcon (Transformers' FalconAttention): ``num_kv_heads`` if ``new_decoder_architecture``
    or not ``multi_query`` (default true), else 1. GPT-BigCode: 1 when ``multi_query``
    (default true). MPT: from ``attn_config``; DBRX: ``attn_config.kv_n_heads``. ChatGLM /
    older GLM-4 (vLLM's chatglm.py): ``multi_query_group_num`` when
    ``multi_query_attention`` (default false), else one per attention head.
    """
    model_type = str(cfg.get("model_type", ""))
    key = next((k for k in _KV_KEYS if cfg.get(k) is not None), _KV_KEYS[0])
    if model_type in FALCON:
        new = flag(cfg, "new_decoder_architecture", source, False)
        if not new and flag(cfg, "multi_query", source, True):
            return 1
        if new and model_type != "falcon" and cfg.get(key) is None:
            # RWConfig defaults n_head_kv to 1, FalconConfig to num_attention_heads
            raise PlanError(f"{source}: a {model_type} config with new_decoder_architecture "
                            "must give 'n_head_kv' (its default differs between Transformers "
                            "and vLLM)")
    elif model_type == "gpt_bigcode":
        return 1 if flag(cfg, "multi_query", source, True) else heads
    elif model_type == "mpt":
        return _mpt_kv_heads(cfg, heads, source)
    elif model_type == "dbrx":  # vLLM's DbrxModelArchConfigConvertor
        attn = cfg.get("attn_config") or {}
        if not isinstance(attn, dict):
            raise PlanError(f"{source}: config field 'attn_config' must be an object, got "
                            f"{brief(attn)}")
        return int_field(attn, "kv_n_heads", source, 1, MAX_DIM,
                         "attn_config.kv_n_heads") or heads
    elif model_type == "chatglm":
        if not flag(cfg, "multi_query_attention", source, False):
            return heads
        return opt_int(cfg, "multi_query_group_num", source, 1, low=1)
    return opt_int(cfg, key, source, heads, low=1)


def _mpt_kv_heads(cfg: dict[str, Any], heads: int, source: str) -> int:
    """MPT (llm-foundry): ``attn_config.attn_type`` picks MHA, MQA or GQA with
    ``attn_config.kv_n_heads``."""
    attn = cfg.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise PlanError(f"{source}: config field 'attn_config' must be an object, got "
                        f"{brief(attn)}")
    kind = attn.get("attn_type")
    given = int_field(attn, "kv_n_heads", source, 1, MAX_DIM, "attn_config.kv_n_heads")
    if kind in _MPT_KV:
        return _MPT_KV[kind] or heads
    if kind == "grouped_query_attention" and given is not None:
        return given
    if kind is None and given is None:
        return heads  # llm-foundry's default attn_type is multihead_attention
    raise PlanError(f"{source}: config field 'attn_config.attn_type' {brief(kind)} with "
                    f"attn_config.kv_n_heads={given} does not say how many KV heads there "
                    "are; give attn_type (multihead_attention, multiquery_attention, or "
                    "grouped_query_attention with kv_n_heads)")


def mlp_width(cfg: dict[str, Any], hidden: int, source: str) -> int:
    """The dense MLP's inner width: ``intermediate_size``, or Falcon's ``ffn_hidden_size``,
    GPT-2's ``n_inner``, OPT's ``ffn_dim``, MPT's ``expansion_ratio`` x ``d_model``; else
    4 x hidden (every one of those configs' default). Llama-4's ``intermediate_size_mlp``
    comes first: its dense layers' width, where ``intermediate_size`` is the experts'. A
    list of one width per layer (Gemma-3n) counts as its mean."""
    if str(cfg.get("model_type", "")) == "lfm2":
        return _lfm2_width(cfg, source)
    for key in ("intermediate_size_mlp", "intermediate_size", "ffn_hidden_size", "n_inner",
                "ffn_dim"):
        widths = cfg.get(key)
        if isinstance(widths, list) and widths:   # one per layer (Gemma-3n): their mean
            each = [opt_int({key: w}, key, source, label=f"{key}[{i}]")
                    for i, w in enumerate(widths)]
            return round(sum(each) / len(each))
        width = opt_int(cfg, key, source)
        if width:
            return width
    ratio = cfg.get("expansion_ratio")
    if str(cfg.get("model_type", "")) == "mpt" and ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) \
                or not 0 < ratio <= _MAX_RATIO:  # (NaN fails the comparison too)
            raise PlanError(f"{source}: config field 'expansion_ratio' must be a number above "
                            f"0 and at most {_MAX_RATIO:g}, got {brief(ratio)}")
        return int(ratio * hidden)
    return 4 * hidden


def _lfm2_width(cfg: dict[str, Any], source: str) -> int:
    """LFM2's MLP width as vLLM's Lfm2MLP adjusts ``intermediate_size``: 2/3 of it, times
    ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``."""
    width = require_int(cfg, "intermediate_size", source)
    if cfg.get("block_auto_adjust_ff_dim", True) is not False:
        width = int(2 * width / 3)
        factor = cfg.get("block_ffn_dim_multiplier")
        if isinstance(factor, int | float) and not isinstance(factor, bool) \
                and 0 < factor <= _MAX_RATIO:
            width = int(factor * width)
        step = opt_int(cfg, "block_multiple_of", source, 256, low=1)
        width = step * -(-width // step)
    return width


def gated_mlp(model_type: str) -> bool:
    """Whether the MLP has a gate matrix beside up and down (Llama, Qwen, Mistral, ...)."""
    return model_type not in TWO_MATRIX_MLP


def attention_output_gate(cfg: dict[str, Any], source: str) -> bool:
    """Whether attention projects a gate beside Q (``GATED_ATTENTION_OUTPUT``): without it
    Qwen3.5-9B's weights were 1.5% short."""
    if str(cfg.get("model_type", "")) not in GATED_ATTENTION_OUTPUT:
        return False
    return flag(cfg, "attn_output_gate", source, True)


def tied_embeddings(cfg: dict[str, Any], source: str) -> bool:
    """``tie_word_embeddings``, defaulting as the model type's config class does."""
    return flag(cfg, "tie_word_embeddings", source,
                str(cfg.get("model_type", "")) in TIED_BY_DEFAULT)
