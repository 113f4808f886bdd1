"""Weights some families keep beside the layers' attention and MLP, read from config.json.

Gemma-3n and Gemma-4 give every layer its own embedding of each token
(``vocab_size_per_layer_input`` x ``hidden_size_per_layer_input`` per layer, 2.3 B of
Gemma-3n-E4B's 6.8 B weights), projected into the layer's input by a gate and a projection
per layer and a model-wide projection. Gemma-3n also runs AltUp (``altup_num_inputs``
copies of the residual, with projections in and out) and LAuReL (a rank-``laurel_rank``
residual per layer). Zamba2 shares its attention and MLP blocks between its hybrid layers.
vLLM loads all of them on the GPU, so the plan counts them: without them Gemma-3n's weights
were 35-42% short and its KV budget that much too large.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.plan.fields import MAX_DIM, opt_int


@dataclass(frozen=True, slots=True)
class SideWeights:
    """Parameters outside the per-layer attention and MLP: ``embeddings`` (looked up,
    never multiplied) and ``dense`` (matrices and norms)."""

    embeddings: int = 0
    dense: int = 0


NO_SIDE_WEIGHTS = SideWeights()
"""What every family without such weights has."""


def read_side_weights(cfg: dict[str, Any], layers: int, hidden: int,
                      source: str) -> SideWeights:
    """The per-layer embeddings, AltUp and LAuReL weights a config declares (zero for
    the families without them)."""
    ple = opt_int(cfg, "hidden_size_per_layer_input", source)
    embeddings = dense = 0
    if ple:
        vocab = opt_int(cfg, "vocab_size_per_layer_input", source,
                        opt_int(cfg, "vocab_size", source), high=MAX_DIM)
        embeddings = vocab * layers * ple
        # the model-wide projection and its norm, then per layer a gate, a projection
        # and the norm after it
        dense = hidden * layers * ple + ple + layers * (2 * hidden * ple + hidden)
    altup = opt_int(cfg, "altup_num_inputs", source, high=64)
    if altup > 1:
        # projections into and out of the extra copies; per layer the router, its norm,
        # the output scale and the prediction and correction coefficients
        dense += 2 * (altup - 1) * hidden * hidden
        dense += layers * (altup * hidden + 2 * hidden + altup * altup * altup + altup * altup)
    laurel = opt_int(cfg, "laurel_rank", source)
    if laurel:
        dense += layers * (2 * hidden * laurel + hidden)
    if str(cfg.get("model_type", "")) == "zamba2":
        dense += _zamba2_shared(cfg, hidden, source)
    return SideWeights(embeddings, dense)


def _zamba2_shared(cfg: dict[str, Any], hidden: int, source: str) -> int:
    """Zamba2's shared transformer blocks (``num_mem_blocks`` of them, each attention over
    [hidden, embeddings] and a gated MLP) and, per hybrid layer, the projection after the
    block and the LoRA adapters of its MLP (and attention), as vLLM's zamba2.py builds
    them. The per-layer Mamba mixers are counted with the layers."""
    types = cfg.get("layers_block_type")
    ids = cfg.get("hybrid_layer_ids")
    hybrid = (types.count("hybrid") if isinstance(types, list)
              else len(ids) if isinstance(ids, list) else 0)
    width = opt_int(cfg, "attention_hidden_size", source, 2 * hidden)
    inner = opt_int(cfg, "intermediate_size", source, 4 * hidden)
    rank = opt_int(cfg, "adapter_rank", source, 128)
    block = 3 * width * width + width * hidden      # Q, K, V over 2 x hidden; O back
    block += 3 * hidden * inner + width + hidden     # gated MLP; the two norms
    adapters = rank * (hidden + 2 * inner)           # the MLP's, one per hybrid layer
    if cfg.get("use_shared_attention_adapter") is True:
        adapters += 3 * rank * 2 * width
    return opt_int(cfg, "num_mem_blocks", source, 1) * block + hybrid * (
        hidden * hidden + adapters)
