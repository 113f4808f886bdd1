"""Reading one field of a model's config.json: bounded integers, flags, and older key names.

Every malformed value is a PlanError naming the field as the config spells it, so a
float, a string, a bool, a negative or an absurd size never reaches the arithmetic.
"""

from __future__ import annotations

from typing import Any

from kvtier.plan.errors import PlanError

MAX_LAYERS = 4096
"""Most layers a config may declare: real models have at most a few hundred (10,000 was
accepted and planned absurd sizes; found by review)."""
MAX_DIM = 2**24
"""Largest size, head count or vocabulary a config may declare (16,777,216: real models'
widest is under 2^17, their largest vocabulary under 2^21)."""
MAX_CONTEXT = 2**31
"""Largest ``max_position_embeddings`` a config may declare."""
MAX_EXPERTS = 1 << 16
"""Most experts a config may declare (MoE models have hundreds)."""

#: Older spellings of the fields the planner reads, as Transformers' ``attribute_map``s
#: (GPT-2, GPT-BigCode, GPT-J, BLOOM, MPT, Falcon/RefinedWeb) and vLLM's RWConfig and
#: ChatGLMConfig (``num_layers``, ``padded_vocab_size``, ``seq_length``) read them.
#: The canonical name wins when a config has both.
ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads"),
    "hidden_size": ("n_embd", "n_embed", "d_model"),
    "max_position_embeddings": ("n_positions", "max_seq_len", "seq_length"),
    "vocab_size": ("padded_vocab_size",),
}


def brief(value: object) -> str:
    """``repr(value)`` cut to 40 characters, for messages."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def key_of(cfg: dict[str, Any], name: str) -> str:
    """The key ``cfg`` spells ``name`` with: ``name`` itself, or an older spelling
    (``n_layer`` for ``num_hidden_layers``) when only that one is set."""
    if cfg.get(name) is not None:
        return name
    return next((k for k in ALIASES.get(name, ()) if cfg.get(k) is not None), name)


def int_field(cfg: dict[str, Any], key: str, source: str, low: int, high: int,
              label: str | None = None) -> int | None:
    """``cfg[key]``: None when absent or null, else an integer from ``low`` to ``high``
    (PlanError naming the field, as ``label`` when given, otherwise)."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PlanError(f"{source}: config field {label or key!r} must be an integer from "
                        f"{low:,} to {high:,}, got {brief(value)}")
    return value


def require_int(cfg: dict[str, Any], key: str, source: str, high: int = MAX_DIM) -> int:
    """A field the plan cannot do without: an integer from 1 to ``high``."""
    value = int_field(cfg, key, source, 1, high)
    if value is None:
        raise PlanError(f"{source}: config field {key!r} is missing; it must be an integer "
                        f"from 1 to {high:,}")
    return value


def opt_int(cfg: dict[str, Any], key: str, source: str, default: int = 0, *, low: int = 0,
            high: int = MAX_DIM, label: str | None = None) -> int:
    """An optional field: ``default`` when absent, null or 0 (how real configs say "not
    set", e.g. a dense model's ``num_local_experts``), else an integer up to ``high``;
    ``low=1`` where 0 makes no sense (``num_key_value_heads``)."""
    return int_field(cfg, key, source, low, high, label) or default


def flag(cfg: dict[str, Any], key: str, source: str, default: bool,
         label: str | None = None) -> bool:
    """A true/false field: ``default`` when absent or null; PlanError when not a bool (a
    string "false" must not count as true)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PlanError(f"{source}: config field {label or key!r} must be true or false, "
                        f"got {brief(value)}")
    return value
