"""DeciLM / Nemotron-NAS: a stack whose layers differ, described by ``block_configs``.

Neural architecture search removed or shrank parts of Llama layers: each entry of
``block_configs`` says whether the layer's attention is kept (with
``num_attention_heads / n_heads_in_group`` KV heads), replaced by one hidden x hidden
matrix (``replace_with_linear``) or skipped (``no_op``), and the same of its MLP, whose
width ``ffn_mult`` sets. Only kept attention holds KV: Llama-3.3-Nemotron-Super-49B keeps
it in 49 of 80 layers. One KV head count for every such layer is modelled (the KV maths
and kvtier's layout take one); a stack that varies it is refused. An attention
``window_length`` is not modelled: such a layer counts as full attention, never less KV
than it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.plan.errors import PlanError
from kvtier.plan.fields import MAX_DIM, brief, flag, int_field

FULL, LINEAR, NONE = "full", "linear", "none"
_MAX_MULT = 1000.0


@dataclass(frozen=True, slots=True)
class Block:
    """One layer: its ``attention`` and ``ffn`` are FULL (the usual sub-layer), LINEAR
    (one hidden x hidden matrix) or NONE (skipped); ``ffn_width`` is the gated MLP's inner
    width when ``ffn`` is FULL."""

    attention: str
    ffn: str
    ffn_width: int = 0


@dataclass(frozen=True, slots=True)
class BlockStack:
    """The layers of a ``block_configs`` model and the KV heads of those with attention."""

    blocks: tuple[Block, ...]
    kv_heads: int


def _find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


def _kind(part: dict[str, Any], where: str, source: str) -> str:
    if flag(part, "no_op", source, False, f"{where}.no_op"):
        return NONE
    if flag(part, "replace_with_linear", source, False, f"{where}.replace_with_linear"):
        return LINEAR
    return FULL


def _part(entry: dict[str, Any], name: str, where: str, source: str) -> dict[str, Any]:
    part = entry.get(name)
    if not isinstance(part, dict):
        raise PlanError(f"{source}: config field '{where}.{name}' must be an object, got "
                        f"{brief(part)}")
    return part


def _ffn_width(ffn: dict[str, Any], hidden: int, where: str, source: str) -> int:
    """The MLP width: ``intermediate_size`` when given, else DeciLM's rule from
    ``ffn_mult``: 2/3 x ffn_mult x hidden, rounded up to a multiple of 256."""
    width = int_field(ffn, "intermediate_size", source, 1, MAX_DIM,
                      f"{where}.ffn.intermediate_size")
    if width is not None:
        return width
    mult = ffn.get("ffn_mult")
    if isinstance(mult, bool) or not isinstance(mult, int | float) \
            or not 0 < mult <= _MAX_MULT:  # (NaN fails the comparison too)
        raise PlanError(f"{source}: config field '{where}.ffn.ffn_mult' must be a number "
                        f"above 0 and at most {_MAX_MULT:g}, got {brief(mult)}")
    return _find_multiple(int(2 * mult * hidden / 3), 256)


def read_blocks(cfg: dict[str, Any], layers: int, heads: int, hidden: int,
                source: str) -> BlockStack | None:
    """The ``block_configs`` stack; None when the config has none (a uniform model)."""
    raw = cfg.get("block_configs")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != layers:
        got = f"{len(raw)} entries" if isinstance(raw, list) else brief(raw)
        raise PlanError(f"{source}: config field 'block_configs' must list one block per "
                        f"layer (num_hidden_layers={layers}), got {got}")
    blocks: list[Block] = []
    groups: dict[int, int] = {}  # n_heads_in_group -> first layer using it
    for i, entry in enumerate(raw):
        where = f"block_configs[{i}]"
        if not isinstance(entry, dict):
            raise PlanError(f"{source}: config field '{where}' must be an object, got "
                            f"{brief(entry)}")
        attn, ffn = _part(entry, "attention", where, source), _part(entry, "ffn", where, source)
        attention = _kind(attn, f"{where}.attention", source)
        if attention == FULL:
            label = f"{where}.attention.n_heads_in_group"
            group = int_field(attn, "n_heads_in_group", source, 1, heads, label)
            if group is None or heads % group:
                raise PlanError(f"{source}: config field {label!r} must divide "
                                f"num_attention_heads={heads}, got {brief(group)}")
            groups.setdefault(group, i)
        mlp = _kind(ffn, f"{where}.ffn", source)
        width = _ffn_width(ffn, hidden, where, source) if mlp == FULL else 0
        blocks.append(Block(attention, mlp, width))
    if not groups:
        raise PlanError(f"{source}: no layer holds attention KV (every block_configs "
                        "attention is no_op or replace_with_linear): there is no KV to plan")
    if len(groups) > 1:
        seen = ", ".join(f"{g} from layer {i}" for g, i in groups.items())
        raise PlanError(f"{source}: config field 'block_configs[].attention.n_heads_in_group' "
                        f"differs between layers ({seen}): the plan models one KV head count "
                        f"per model; for an upper bound, set every one to {min(groups)}")
    return BlockStack(tuple(blocks), heads // next(iter(groups)))
