"""Weights some families keep beside the layers' attention and MLP, read from config.json.

Gemma-3n and Gemma-4 give every layer its own embedding of each token
(``vocab_size_per_layer_input`` x ``hidden_size_per_layer_input`` per layer, 2.3 B of
Gemma-3n-E4B's 6.8 B weights), projected into the layer's input by a gate and a projection
per layer and a model-wide projection. Gemma-3n also runs AltUp (``altup_num_inputs``
copies of the residual, with projections in and out) and LAuReL (a rank-``laurel_rank``
residual per layer). vLLM loads all of them on the GPU, so the plan counts them: without
them its weights were 35-42% short and its KV budget that much too large.
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
    return SideWeights(embeddings, dense)
