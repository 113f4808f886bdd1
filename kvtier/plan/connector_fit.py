"""How vLLM runs a model beside kvtier's vLLM connector, for the plan.

Whether the connector refuses a model at start (and the setting that gets it served), and
which windowed layers then keep every token (vLLM turns its hybrid KV cache manager off
for the connector), so kvtier.plan.planner sizes HBM and the tiers for the model as it
runs. Model rules only: no arithmetic of the plan, and nothing of kvtier.plan.planner.
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.plan.layers import NO_KV
from kvtier.plan.model import ModelSpec


def connector_refuses(m: ModelSpec) -> bool:
    """Whether kvtier's vLLM connector refuses the model at start: more than one KV cache
    group (recurrent-state layers, DeepSeek-V3.2's indexer cache), layers of different
    page sizes (Gemma-4: vLLM groups them in a UniformTypeKVCacheSpecs, not one of the
    connector's ``KEEPS_EVERY_TOKEN`` specs), layers sharing another's KV (Gemma-3n: the
    worker refuses them at register_kv_caches), or windowed layers with no full-attention
    layer beside them (vLLM keeps them windowed, freeing old pages, even where the window
    is as long as the context)."""
    full = sum(1 for w in m.layer_windows if w is None)
    return bool(m.state_layers or any(m.indexer_layers) or not m.uniform_pages
                or m.shared_kv_layers or (m.windowed_layers and not full))


def refusal_reason(m: ModelSpec) -> str:
    """Why the connector refuses the model, in a few words (see connector_refuses)."""
    if m.state_layers:
        return "recurrent-state layers beside the attention KV"
    if any(m.indexer_layers):
        return "a sparse-attention indexer cache beside the latent"
    if not m.uniform_pages:
        return ("layers of different KV page sizes (different KV heads or head sizes), "
                "which vLLM groups in a UniformTypeKVCacheSpecs")
    if m.shared_kv_layers:
        return (f"{m.shared_kv_layers} layers that read another layer's KV "
                "(num_kv_shared_layers), which the connector cannot save or load")
    return "sliding-window layers alone (vLLM builds a SlidingWindowSpec for them)"


def way_out(m: ModelSpec) -> str:
    """For sliding-window layers alone, the setting under which the connector serves the
    model: vLLM's --disable-sliding-window (full-attention pages, max_model_len capped)."""
    if (m.state_layers or any(m.indexer_layers) or m.chunked_local_attention
            or not m.uniform_pages or m.shared_kv_layers):
        return ""
    window = max(w for w in m.layer_windows if w)
    if m.max_context and window >= m.max_context:
        return (f"; with vLLM's --disable-sliding-window it is served (the {window:,}-token "
                f"window reaches past the {m.max_context:,}-token context, so every layer "
                "keeps every token either way)")
    return (f"; with vLLM's --disable-sliding-window it is served (max_model_len capped at "
            f"the {window:,}-token window, every layer full attention)")


def chunked_turns_hybrid_off(m: ModelSpec) -> bool:
    """Whether vLLM runs the model without its hybrid KV cache manager with no KV connector
    too: chunked local attention (``attention_chunk_size``) turns it off by default
    (vllm/config/vllm.py; VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 keeps it),
    and windowed layers beside full-attention ones are then allocated as full attention."""
    full = any(w is None for w in m.layer_windows)
    return m.chunked_local_attention and bool(m.windowed_layers) and full


def window_note(m: ModelSpec, runs: ModelSpec, p99_bytes: int, windowed: int) -> str:
    """What the windowed layers hold: their window, or every token and who decides so."""
    window = max(w for w in m.layer_windows if w)
    head = (f"{m.windowed_layers} of {m.num_layers} layers use a sliding or chunked window "
            f"of {window:,} tokens")
    if runs is m:
        if m.max_context and window >= m.max_context:
            return f"{head}, at least the {m.max_context:,}-token context: they keep every token"
        return f"{head}: their KV stops growing"
    planned = (f"those layers keep every token, in HBM and in the tiers: planned so "
               f"({p99_bytes / 1e9:.2f} GB per P99 sequence")
    if chunked_turns_hybrid_off(m):
        return (f"{head}, but vLLM runs chunked local attention without its hybrid KV cache "
                f"manager by default, with or without kvtier, so {planned}; "
                f"{windowed / 1e9:.2f} GB only "
                "with VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 and no KV "
                "connector)")
    return (f"{head}, but with kvtier's vLLM connector vLLM runs without its hybrid KV cache "
            f"manager and {planned}, {windowed / 1e9:.2f} GB without kvtier)")


def as_the_connector_runs(m: ModelSpec) -> ModelSpec:
    """The model as vLLM runs it with kvtier's connector: windowed layers beside
    full-attention ones keep every token (vLLM turns its hybrid KV cache manager off for a
    connector that does not declare support for it, and allocates them as full attention).
    ``m`` itself when that changes nothing or the connector refuses the model."""
    if not m.windowed_layers or connector_refuses(m):
        return m
    return replace(m, layer_windows=tuple(None if w != NO_KV else w for w in m.layer_windows))
