"""The capacity plan: weights and KV per GPU, sequences that fit, spill, tier sizes.

Pure arithmetic over a ModelSpec, a GPU and a workload; no I/O. The topology is
``gpus`` GPUs on one node, split into ``gpus / tp`` engine instances (replicas) of
``tp`` GPUs each; ``concurrency`` running sequences are spread evenly over replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.layout import default_tokens_per_block
from kvtier.plan.connector_fit import (
    as_the_connector_runs,
    connector_refuses,
    refusal_reason,
    way_out,
    window_note,
)
from kvtier.plan.errors import PlanError
from kvtier.plan.hardware import GIB, GPUSpec
from kvtier.plan.indexer import indexer_bytes
from kvtier.plan.kvmath import (
    FP8_DS_MLA_BYTES,
    check_tensor_parallel,
    estimate_params,
    is_fp8_ds_mla,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_share_per_rank,
    weights_bytes,
    weights_format,
)
from kvtier.plan.model import AttentionKind, ModelSpec
from kvtier.plan.workload import MAX_CONTEXT, ContextPercentiles, TraceSummary

#: Model FLOPs utilisation assumed for prefill time estimates.
PREFILL_MFU = 0.5
#: NVMe is sized at this multiple of the CPU tier when no trace gives the working set.
NVME_PER_CPU = 4
# The daemon's own memory per block it indexes (arena or nvme), in Python objects: index,
# policies, journal record. Measured: 1.5 KB per arena block, 1.3 KB per nvme block
# (docs/operations.md, "The daemon's own memory").
DAEMON_BYTES_PER_BLOCK = 1536
DAEMON_NOTE_SHARE = 0.02   # note it when it passes this share of the cpu tier
MAX_CONCURRENCY = 10**7    # --concurrency: more is a typo (10**24 printed a 10**20 GB plan)
MAX_GPUS = 4096  # --gpus on one node (largest NVLink domain: 576; found by review)
MAX_PAGE_TOKENS = 1 << 20  # --block-size, --tokens-per-block (vLLM pages: 16 to 256 tokens)
MAX_COUNTED_PARAMS = 1e15  # as --params: a config counting more is not a real model
#: Prompt tokens at P50/P95/P99 when neither --context nor --trace is given.
DEFAULT_CONTEXT = ContextPercentiles(2048, 4096, 8192)


@dataclass(frozen=True, slots=True)
class PlanInput:
    """Everything ``kvtier plan`` takes; validated by ``make_plan``."""

    model: ModelSpec
    gpu: GPUSpec
    kv_dtype: str
    weights_dtype: str | None = None  # None: the checkpoint's dtype and quantization
    gpus: int = 1
    tp: int = 1
    mem_util: float = 0.9
    reserve_bytes: int = 0  # activations, CUDA graphs, NCCL buffers
    concurrency: int = 32
    context: ContextPercentiles = DEFAULT_CONTEXT
    max_output: int = 0
    prefix_share: float = 0.0
    block_tokens: int = 16  # the engine's KV page
    kvtier_block_tokens: int | None = None  # kvtier's block (one key); None: the default
    params_override: int | None = None
    trace: TraceSummary | None = None


@dataclass(frozen=True, slots=True)
class TierSize:
    """A recommended kvtier tier size and the reason for it."""

    tier: str
    bytes: int
    why: str


@dataclass(frozen=True, slots=True)
class Plan:
    """The result: every number the table, the JSON and the plot show."""

    inputs: PlanInput
    weights_dtype: str  # what the weights were counted as: "bf16", "awq int4", ...
    params: int
    active_params: int
    weights_bytes: int
    weights_bytes_per_gpu: int
    replicas: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    sequence_tokens: dict[str, int]
    kv_bytes_per_sequence: dict[str, int]
    kv_budget_bytes_per_gpu: int
    max_sequences_in_hbm: dict[str, int]  # whole deployment (all replicas)
    kv_pool_bytes: int  # HBM KV pools of all instances, counted once per token (not per rank)
    kv_demand_bytes_p99: int  # concurrency x P99 sequence
    spill_bytes_p99: int  # P99 sequences beyond what HBM holds, whole sequences
    tiers: tuple[TierSize, ...]  # physical bytes: ``stored_copies`` copies of the KV
    stored_copies: int  # copies of each token's KV the TP ranks store (replicated heads)
    kvtier_block_tokens: int  # tokens per kvtier block (one key)
    daemon_blocks: int  # blocks of one TP rank's size the cpu and nvme tiers hold at most
    daemon_memory_bytes: int  # the daemon's private memory for indexing them
    prefill_saving: dict[str, float]
    decode_step_s_p99: float
    decode_sequences_p99: int  # per engine instance, resident in HBM
    notes: tuple[str, ...] = field(default_factory=tuple)


def _round_up_gib(n: float) -> int:
    return int(math.ceil(n / GIB) * GIB) if n > 0 else 0


def _validate(p: PlanInput) -> None:
    check_tensor_parallel(p.model, p.tp)  # first: it rejects --tp 0 before it divides --gpus
    if not 0 < p.gpus <= MAX_GPUS or p.gpus % p.tp:
        raise PlanError(f"--gpus {p.gpus} must be a positive multiple of --tp {p.tp}, at "
                        f"most {MAX_GPUS}")
    if not 0.0 < p.mem_util <= 1.0:
        raise PlanError(f"--mem-util must be in (0, 1], got {p.mem_util}")
    if not 0 < p.concurrency <= MAX_CONCURRENCY:
        raise PlanError(f"--concurrency must be from 1 to {MAX_CONCURRENCY:,}, got "
                        f"{p.concurrency}")
    if not 0.0 <= p.prefix_share <= 1.0:
        raise PlanError(f"--prefix-share must be in [0, 1], got {p.prefix_share}")
    if not 0 <= p.max_output <= MAX_CONTEXT:
        raise PlanError(f"--max-output must be from 0 to {MAX_CONTEXT:,}, got {p.max_output}")
    if not 0 < p.block_tokens <= MAX_PAGE_TOKENS:
        raise PlanError(f"--block-size must be positive and at most {MAX_PAGE_TOKENS:,} "
                        f"tokens, got {p.block_tokens}")
    kb = p.kvtier_block_tokens
    if kb is not None and (not 0 < kb <= MAX_PAGE_TOKENS or kb % p.block_tokens):
        raise PlanError(f"--tokens-per-block {kb} must be a positive multiple of --block-size "
                        f"{p.block_tokens} (the connector stores whole engine pages), at most "
                        f"{MAX_PAGE_TOKENS:,}")


def make_plan(p: PlanInput) -> Plan:
    """Compute the capacity plan for one model, GPU type, topology and workload."""
    _validate(p)
    m = p.model
    notes: list[str] = []
    fmt = weights_format(m, p.weights_dtype)
    counted = estimate_params(m)
    if not m.vocab_size and p.params_override is None:
        raise PlanError(f"{m.name}: config field 'vocab_size' is missing (text_config and "
                        "outer config alike): the KV is planned without it, the weights' "
                        "embeddings are not; pass --params with the model card's parameter "
                        "count (e.g. --params 27B)")
    if counted.total > MAX_COUNTED_PARAMS:
        raise PlanError(f"{m.name}: the config's sizes count {counted.total:.3g} parameters, "
                        f"more than {MAX_COUNTED_PARAMS:g}: not a real model's config")
    params = p.params_override or counted.total
    active = counted.active if p.params_override is None else int(
        p.params_override * counted.active / counted.total)
    weights = weights_bytes(counted, fmt, params)
    weights_gpu = math.ceil(weights / p.tp)
    replicas = p.gpus // p.tp

    per_token = kv_bytes_per_token(m, p.kv_dtype)
    share = kv_share_per_rank(m, p.tp)
    per_token_gpu = int(per_token * share)
    copies = round(share * p.tp)  # how many times the TP group stores each KV byte
    # what the tiers store of each token: a rank's copy of replicated heads is saved under
    # its own namespace; an MLA latent, the same on every rank, once (rank 0 saves it)
    stored = 1 if m.attention is AttentionKind.MLA else copies
    if copies > 1 and m.attention is AttentionKind.MLA:
        notes.append(f"MLA: each of the {p.tp} TP ranks holds the whole latent, so the TP "
                     f"group stores {copies} copies of every token's KV in HBM")
    elif copies > 1:
        notes.append(f"{m.num_kv_heads} KV heads over TP {p.tp}: ranks hold copies "
                     f"({copies}x the model's KV per token across the TP group), in HBM and "
                     "in kvtier's tiers (sized for all of them)")
    if m.attention is AttentionKind.MLA and p.tp > 1:
        notes.append("kvtier's vLLM connector offloads one copy of the latent: rank 0 saves "
                     "it, every rank loads it")

    if any(m.indexer_layers):
        notes.append(f"sparse attention: {sum(m.indexer_layers)} layers also keep the indexer's "
                     f"keys, {indexer_bytes(m.index_head_dim)} B per token per layer (fp8 and "
                     "scales whatever --kv-dtype), counted in the KV above")
    if is_fp8_ds_mla(m, p.kv_dtype):
        notes.append(f"sparse MLA with fp8 KV: vLLM stores the latent as fp8_ds_mla, "
                     f"{FP8_DS_MLA_BYTES} B per token per layer (fp8 latent, fp32 scales, bf16 "
                     "RoPE), not one byte per value")
    seq_tokens: dict[str, int] = {}
    for name, ctx in p.context.items():
        tokens = ctx + p.max_output
        if m.max_context and tokens > m.max_context:
            notes.append(f"{name.upper()} of {tokens:,} tokens exceeds the model's context "
                         f"window of {m.max_context:,}; planned at {m.max_context:,}")
            tokens = m.max_context
        seq_tokens[name] = tokens
    runs = as_the_connector_runs(m)
    seq_bytes = {k: kv_bytes_per_sequence(runs, p.kv_dtype, t, p.block_tokens)
                 for k, t in seq_tokens.items()}
    if m.windowed_layers:
        windowed = kv_bytes_per_sequence(m, p.kv_dtype, seq_tokens["p99"], p.block_tokens)
        notes.append(window_note(m, runs, seq_bytes["p99"], windowed))
    if m.kv_layers < m.num_layers or m.state_layers:
        notes.append(_hybrid_note(m))
    if connector_refuses(m):
        notes.append("kvtier's vLLM connector refuses this model at start (it takes one KV "
                     "cache group of full-attention or MLA layers: not recurrent-state "
                     "layers, an indexer cache, layers of different page sizes, or windowed "
                     f"layers alone; this model has {refusal_reason(m)}), so the tier sizes "
                     "above assume an engine that offloads them" + way_out(m))
    if m.checkpoint_kv_dtype and p.kv_dtype == m.checkpoint_kv_dtype:
        notes.append(f"KV planned in {p.kv_dtype}: the checkpoint's quantization_config "
                     "quantizes the KV cache and vLLM's --kv-cache-dtype auto follows it; "
                     "pass --kv-dtype bf16 if you serve it with --kv-cache-dtype bfloat16")

    budget = int(p.gpu.memory_bytes * p.mem_util) - weights_gpu - p.reserve_bytes
    if budget <= 0:
        notes.append(_weights_note(p, weights, weights_gpu))
    pool = int(max(budget, 0) / share)  # one instance's HBM KV pool, in model KV bytes
    fits_one = {k: pool // b if b else 0 for k, b in seq_bytes.items()}
    fits = {k: n * replicas for k, n in fits_one.items()}

    per_replica = math.ceil(p.concurrency / replicas)
    demand = p.concurrency * seq_bytes["p99"]
    spill = max(0, per_replica - fits_one["p99"]) * seq_bytes["p99"] * replicas
    tiers = _tiers(p, spill, pool * replicas, per_token, stored)
    kvtier_block = p.kvtier_block_tokens or default_tokens_per_block(p.block_tokens)
    daemon_blocks, daemon_memory = _daemon_memory(tiers, kvtier_block * per_token_gpu)
    cpu_bytes = next(t.bytes for t in tiers if t.tier == "cpu")
    if cpu_bytes and daemon_memory > DAEMON_NOTE_SHARE * cpu_bytes:
        notes.append(f"kvtier blocks of {kvtier_block} tokens are "
                     f"{kvtier_block * per_token_gpu:,} B per rank: the daemon's own memory for "
                     f"{daemon_blocks:,} blocks ({daemon_memory / 1e9:.1f} GB) is "
                     f"{daemon_memory / cpu_bytes:.0%} of the cpu tier; budget it beside "
                     "cpu.bytes, or use more tokens per block")
    saving = _prefill_saving(p, active, seq_tokens["p50"])
    resident = min(per_replica, fits_one["p99"])  # sequences decoding from HBM
    kv_read = resident * seq_bytes["p99"] * share  # per GPU
    decode_s = (weights_gpu + kv_read) / p.gpu.bandwidth_bytes_s
    return Plan(
        inputs=p, weights_dtype=fmt.label, params=params, active_params=active,
        weights_bytes=weights, weights_bytes_per_gpu=weights_gpu, replicas=replicas,
        kv_bytes_per_token=per_token, kv_bytes_per_token_per_gpu=per_token_gpu,
        sequence_tokens=seq_tokens, kv_bytes_per_sequence=seq_bytes,
        kv_budget_bytes_per_gpu=budget, max_sequences_in_hbm=fits,
        kv_pool_bytes=pool * replicas, kv_demand_bytes_p99=demand, spill_bytes_p99=spill,
        tiers=tiers, stored_copies=stored, kvtier_block_tokens=kvtier_block,
        daemon_blocks=daemon_blocks,
        daemon_memory_bytes=daemon_memory,
        prefill_saving=saving, decode_step_s_p99=decode_s,
        decode_sequences_p99=resident, notes=tuple(notes),
    )


def _tiers(p: PlanInput, spill: int, hbm_pool: int, per_token: int,
           copies: int) -> tuple[TierSize, ...]:
    """kvtier tier sizes for the node: CPU catches spill and HBM evictions, NVMe the rest.

    ``spill``, ``hbm_pool`` and ``per_token`` count each token's KV once; the connector
    stores each TP rank's KV under its own namespace, so where ranks hold copies of KV heads
    the tiers hold ``copies`` of it: the sizes are those bytes.
    """
    times = f" x {copies} copies (one per TP rank that holds it)" if copies > 1 else ""
    cpu = _round_up_gib((spill + hbm_pool) * copies)
    cpu_why = (f"(P99 spill {spill / 1e9:.1f} GB + one HBM KV pool "
               f"({hbm_pool / 1e9:.1f} GB) for prefixes evicted from the GPU){times}"
               if copies > 1 else
               f"P99 spill {spill / 1e9:.1f} GB + one HBM KV pool "
               f"({hbm_pool / 1e9:.1f} GB) for prefixes evicted from the GPU")
    tr = p.trace
    if tr is not None:
        working = tr.reused_blocks * tr.block_tokens * per_token * copies
        nvme = _round_up_gib(max(working, cpu))
        nvme_why = (f"every reused prefix in the trace: {tr.reused_blocks:,} blocks x "
                    f"{tr.block_tokens} tokens{times} = {working / 1e9:,.1f} GB"
                    + ("" if working >= cpu else "; at least the CPU tier, to take its "
                       "evictions"))
    else:
        working = 0
        nvme = cpu * NVME_PER_CPU
        nvme_why = f"{NVME_PER_CPU}x the CPU tier (no trace to measure the reused prefixes)"
    tiers = [TierSize("cpu", cpu, cpu_why), TierSize("nvme", nvme, nvme_why)]
    replicas = p.gpus // p.tp
    if replicas > 1:
        shared = _round_up_gib(working) if working else cpu
        tiers.append(TierSize("redis", shared, f"shares prefixes across {replicas} engine "
                                               "instances"))
    else:
        tiers.append(TierSize("redis", 0, "not needed: one engine instance"))
    return tuple(tiers)


def _weights_note(p: PlanInput, weights: int, weights_gpu: int) -> str:
    """Weights that do not fit: the smallest TP that holds them with room left for KV
    (weights that fill a GPU exactly leave none) and shards the heads."""
    room = p.gpu.memory_bytes * p.mem_util - p.reserve_bytes
    need = math.floor(weights / room) + 1 if room > 0 else None
    fit = None if need is None else next(
        (t for t in range(need, p.model.num_attention_heads + 1) if _shards(p.model, t)), None)
    advice = (f"use TP {fit} (the smallest TP that holds them and shards the heads) or a "
              "smaller weights dtype" if fit is not None else
              "no TP that shards the heads holds them; use a smaller weights dtype or GPU "
              "with more memory")
    return f"weights do not fit: {weights_gpu / 1e9:.1f} GB per GPU at TP {p.tp}; {advice}"


def _shards(m: ModelSpec, tp: int) -> bool:
    """Whether an engine can shard this model's heads over ``tp`` ranks."""
    try:
        check_tensor_parallel(m, tp)
    except PlanError:
        return False
    return True


def _hybrid_note(m: ModelSpec) -> str:
    """What a hybrid model's layers without KV mean for the plan."""
    no_kv = m.num_layers - m.kv_layers
    if m.blocks:
        return (f"only {m.kv_layers} of {m.num_layers} layers hold attention KV: block_configs "
                f"skips attention (no_op) or replaces it with a linear layer in {no_kv}; "
                "weights are counted block by block")
    state = (f"{m.state_layers} carry a fixed-size recurrent state per sequence (linear "
             "attention, SSM or convolution) that the engine keeps in HBM beside the KV: not "
             "counted here, and not stored by kvtier" if m.state_layers else "")
    known = m.mixers is not None and (any(m.mixers.state) or not all(m.mixers.mlp))
    weights = ("Weights count each layer's own blocks (Mamba, DeltaNet, convolution, "
               "attention, MLP)" if known else "Weights are counted as if every layer were "
               "attention + MLP: pass --params for the exact count")
    if not no_kv:  # Falcon-H1: attention and Mamba side by side in every layer
        return (f"hybrid model: all {m.num_layers} layers hold attention KV and {state}. "
                + weights)
    return (f"hybrid model: only {m.kv_layers} of {m.num_layers} layers hold attention KV, "
            f"{no_kv} hold none" + (f"; {state}" if state else "") + f". {weights}")


def _daemon_memory(tiers: tuple[TierSize, ...], block_bytes: int) -> tuple[int, int]:
    """Blocks the daemon indexes when its cpu and nvme tiers are full (a block in both
    counted twice: an upper bound), and the private memory that takes."""
    held = sum(t.bytes for t in tiers if t.tier in ("cpu", "nvme"))
    blocks = math.ceil(held / block_bytes) if block_bytes else 0
    return blocks, blocks * DAEMON_BYTES_PER_BLOCK


def _prefill_saving(p: PlanInput, active_params: int, p50_tokens: int) -> dict[str, float]:
    """Prefill work skipped when a share of prompt tokens comes from reused KV.

    Prefill costs about 2 FLOPs per active parameter per token (attention's quadratic
    term left out, so long prompts save somewhat more than shown).
    """
    share = p.prefix_share if p.trace is None else p.trace.prefix_share
    prompt = p.context.p50 if p.trace is None else p.trace.prompt_tokens.p50
    flops = 2.0 * active_params * prompt
    saved = flops * share
    tp_flops = p.gpu.bf16_flops * p.tp * PREFILL_MFU
    return {
        "prefix_share": share,
        "prompt_tokens_p50": float(prompt),
        "prefill_flops_p50": flops,
        "saved_flops_p50": saved,
        "prefill_seconds_p50": flops / tp_flops,
        "saved_seconds_p50": saved / tp_flops,
    }
