"""Mutation-review pins for ``kvtier plan``'s planner: TP pools, replicas, spill, tiers.

Every expected number is worked by hand from the model's published geometry and the
inputs, so a planner that drifts from the arithmetic an operator would do fails here.
"""

from __future__ import annotations

import pytest

from kvtier.plan import PlanError
from kvtier.plan.hardware import GIB, GPUSpec, find_gpu
from kvtier.plan.model import load_model, spec_from_config
from kvtier.plan.planner import NVME_PER_CPU, Plan, PlanInput, make_plan
from kvtier.plan.workload import ContextPercentiles, TraceSummary
from kvtier.replay.trace import TraceFormat
from tests.unit.test_plan_vllm_families import LLAMA_8B

LLAMA3_8B_WEIGHTS = 8_030_261_248 * 2  # bf16
SEQ_2K = 2048 * 131_072  # Llama-3-8B: 128 KiB of KV per token


def _gpu(memory: int) -> GPUSpec:
    return GPUSpec("test", memory, 1e12, 1e15)


def _two_replicas(concurrency: int, *, fits: int = 10, reserve: int = 0) -> Plan:
    """Llama-3-8B on two GPUs of one engine each, each GPU's KV budget holding ``fits``
    2,048-token sequences and 1,000 B besides."""
    memory = LLAMA3_8B_WEIGHTS + fits * SEQ_2K + 1000 + reserve
    return make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=_gpu(memory),
                               kv_dtype="bf16", gpus=2, tp=1, mem_util=1.0,
                               reserve_bytes=reserve, concurrency=concurrency,
                               context=ContextPercentiles(2048, 2048, 2048)))


def test_tp8_kv_pool_is_eight_ranks_of_kv_heads() -> None:
    """Llama-3-70B at TP 8 on H100s: each rank holds 1 of the 8 KV heads, so the engine's
    pool is 8 GPUs' budgets (477 GB), not one GPU's (60 GB): 177 P99 sequences of 8,192
    tokens fit, not 22."""
    plan = make_plan(PlanInput(model=load_model("llama-3-70b"), gpu=find_gpu("h100"),
                               kv_dtype="bf16", gpus=8, tp=8, concurrency=200,
                               context=ContextPercentiles(8192, 8192, 8192)))
    weights_gpu = -(-70_553_706_496 * 2 // 8)
    budget = int(80 * GIB * 0.9) - weights_gpu
    assert plan.kv_budget_bytes_per_gpu == budget == 59_670_984_704
    assert plan.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2 == 327_680
    assert plan.kv_bytes_per_token_per_gpu == 327_680 // 8
    assert plan.kv_pool_bytes == 8 * budget
    seq = 8192 * 327_680
    assert plan.max_sequences_in_hbm["p99"] == 8 * budget // seq == 177
    assert plan.spill_bytes_p99 == (200 - 177) * seq
    assert plan.decode_sequences_p99 == 177
    # every GPU reads the weights and its eighth of the KV of the resident sequences
    assert plan.decode_step_s_p99 == pytest.approx(
        (weights_gpu + 177 * seq / 8) / find_gpu("h100").bandwidth_bytes_s)


def test_concurrency_is_split_over_replicas_rounding_up() -> None:
    """21 sequences over 2 instances that each hold 10: the busier one runs 11 and spills
    one whole sequence. Rounding 21/2 down planned no spill for 21 sequences in room for
    20; the plan counts that one spill per replica (worst case, as documented)."""
    plan = _two_replicas(21)
    assert plan.replicas == 2
    assert plan.max_sequences_in_hbm == {"p50": 20, "p95": 20, "p99": 20}
    assert plan.kv_pool_bytes == 2 * (10 * SEQ_2K + 1000)
    assert plan.kv_demand_bytes_p99 == 21 * SEQ_2K
    assert plan.spill_bytes_p99 == 1 * SEQ_2K * 2
    assert plan.decode_sequences_p99 == 10
    assert _two_replicas(20).spill_bytes_p99 == 0


def test_tiers_take_every_replicas_pool_and_spill() -> None:
    """The CPU tier takes the spill of both instances and both HBM pools (evicted
    prefixes); with two instances redis shares prefixes and is as large as the CPU tier,
    NVMe is NVME_PER_CPU times it."""
    plan = _two_replicas(25)
    tiers = {t.tier: t.bytes for t in plan.tiers}
    spill = (13 - 10) * SEQ_2K * 2
    pool = 2 * (10 * SEQ_2K + 1000)
    assert plan.spill_bytes_p99 == spill
    cpu = -(-(spill + pool) // GIB) * GIB
    assert tiers == {"cpu": cpu, "nvme": cpu * NVME_PER_CPU, "redis": cpu}
    assert cpu == 7 * GIB  # 6.98 GB rounded up to whole GiB


def test_few_sequences_decode_only_those_that_run() -> None:
    """With 4 sequences over 2 instances, each decodes 2, not the 10 its HBM could hold:
    the decode step reads 2 sequences' KV beside the weights."""
    plan = _two_replicas(4)
    assert plan.decode_sequences_p99 == 2
    assert plan.decode_step_s_p99 == pytest.approx((LLAMA3_8B_WEIGHTS + 2 * SEQ_2K) / 1e12)


def test_reserve_comes_out_of_the_kv_budget() -> None:
    """--reserve-gb (activations, CUDA graphs, NCCL) is memory the KV cannot use: a GPU
    with 5 GB more and 5 GB reserved holds the same 10 sequences, not 28."""
    plan = _two_replicas(10, reserve=5_000_000_000)
    assert plan.kv_budget_bytes_per_gpu == 10 * SEQ_2K + 1000
    assert plan.max_sequences_in_hbm["p99"] == 20


def test_prefill_saving_divides_over_the_tp_group() -> None:
    """Prefill runs on all TP ranks at once: 2 x active params x prompt FLOPs over TP x
    the GPU's dense FLOPs x 50% MFU."""
    plan = make_plan(PlanInput(model=load_model("llama-3-70b"), gpu=find_gpu("h100"),
                               kv_dtype="bf16", gpus=8, tp=8, prefix_share=0.5,
                               context=ContextPercentiles(4096, 4096, 4096)))
    flops = 2.0 * 70_553_706_496 * 4096
    saving = plan.prefill_saving
    assert saving["prefill_flops_p50"] == flops
    assert saving["prefill_seconds_p50"] == pytest.approx(flops / (989e12 * 8 * 0.5))
    assert saving["saved_seconds_p50"] == pytest.approx(saving["prefill_seconds_p50"] / 2)


def test_gpus_not_a_multiple_of_tp_are_refused() -> None:
    """An engine instance takes --tp GPUs: 12 GPUs cannot be split into TP-8 instances."""
    with pytest.raises(PlanError, match="multiple of --tp 8"):
        make_plan(PlanInput(model=load_model("llama-3-70b"), gpu=find_gpu("h100"),
                            kv_dtype="bf16", gpus=12, tp=8))


def _trace(reused_blocks: int, prefix_share: float = 0.25) -> TraceSummary:
    """A measured trace: 2,048-token sequences, 512-token blocks."""
    tokens = ContextPercentiles(2048, 2048, 2048)
    return TraceSummary(path="t.jsonl", format=TraceFormat.MOONCAKE, requests=100,
                        block_tokens=512, sequence_tokens=tokens,
                        prompt_tokens=ContextPercentiles(1024, 1536, 2048),
                        output_tokens_p99=0, prefix_share=prefix_share,
                        block_hit_share=0.3, unique_blocks=400,
                        reused_blocks=reused_blocks)


def _traced(reused_blocks: int) -> Plan:
    memory = LLAMA3_8B_WEIGHTS + 10 * SEQ_2K + 1000
    return make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=_gpu(memory),
                               kv_dtype="bf16", gpus=2, tp=1, mem_util=1.0, concurrency=20,
                               context=ContextPercentiles(2048, 2048, 2048),
                               prefix_share=0.9, trace=_trace(reused_blocks)))


def test_a_trace_sizes_nvme_and_redis_by_its_reused_prefixes() -> None:
    """With a trace, NVMe holds every reused prefix but never less than the CPU tier (it
    takes the CPU tier's evictions), and redis, shared by the instances, holds the reused
    prefixes only; the prefill saving is the trace's measured share of its P50 prompt."""
    cpu = -(-2 * (10 * SEQ_2K + 1000) // GIB) * GIB
    small = {t.tier: t.bytes for t in _traced(8).tiers}  # 8 x 512 tokens: 0.5 GB
    working = 8 * 512 * 131_072
    assert small == {"cpu": cpu, "nvme": cpu, "redis": GIB}
    assert working < GIB < cpu
    big = {t.tier: t.bytes for t in _traced(400).tiers}  # 26.8 GB of reused prefixes
    assert big["nvme"] == big["redis"] == -(-400 * 512 * 131_072 // GIB) * GIB == 25 * GIB
    saving = _traced(8).prefill_saving
    assert (saving["prefix_share"], saving["prompt_tokens_p50"]) == (0.25, 1024.0)
    assert saving["prefill_flops_p50"] == 2.0 * 8_030_261_248 * 1024


def _weights_note(plan: Plan) -> str:
    return next(n for n in plan.notes if n.startswith("weights do not fit"))


def test_weights_advice_rounds_the_gpus_needed_up() -> None:
    """Llama-3-70B's 141 GB of bf16 weights need 1.8 H100s of room: the advice is TP 2,
    never TP 1, which is what the plan already shows not to fit."""
    plan = make_plan(PlanInput(model=load_model("llama-3-70b"), gpu=find_gpu("h100"),
                               kv_dtype="bf16"))
    assert "use TP 2 (the smallest TP" in _weights_note(plan)


def test_weights_advice_may_be_tp_equal_to_the_attention_heads() -> None:
    """A TP as large as num_attention_heads (32 for Llama-3-8B) still shards them: when
    only TP 32 holds the weights, the advice names it rather than giving up."""
    plan = make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=_gpu(566_666_667),
                               kv_dtype="bf16"))
    assert "use TP 32 (the smallest TP" in _weights_note(plan)


def test_daemon_blocks_round_a_partial_block_up() -> None:
    """The daemon indexes whole blocks: 5 x 7 GiB of cpu and nvme tiers in 48-token
    blocks of 6 MiB is 5,973.3 blocks, so 5,974 are budgeted at 1,536 B each."""
    memory = LLAMA3_8B_WEIGHTS + 10 * SEQ_2K + 1000
    plan = make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=_gpu(memory),
                               kv_dtype="bf16", gpus=2, tp=1, mem_util=1.0, concurrency=25,
                               context=ContextPercentiles(2048, 2048, 2048),
                               kvtier_block_tokens=48))
    held = sum(t.bytes for t in plan.tiers if t.tier in ("cpu", "nvme"))
    assert held == 5 * 7 * GIB
    assert plan.daemon_blocks == -(-held // (48 * 131_072)) == 5974
    assert plan.daemon_memory_bytes == 5974 * 1536


def test_weights_that_fill_the_gpu_exactly_leave_no_kv_and_say_so() -> None:
    """A GPU whose usable memory is exactly the weights has 0 B for KV: no sequence fits
    and the plan says the weights do not fit, rather than planning an empty pool quietly."""
    plan = make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=_gpu(LLAMA3_8B_WEIGHTS),
                               kv_dtype="bf16", mem_util=1.0))
    assert plan.kv_budget_bytes_per_gpu == 0
    assert plan.max_sequences_in_hbm["p99"] == 0
    assert "16.1 GB per GPU at TP 1" in _weights_note(plan)


def test_weights_advice_never_repeats_the_tp_that_left_no_kv() -> None:
    """Weights that fill the GPU exactly leave no KV at TP 1, yet the advice reads "use
    TP 1": the TP it names must leave room for KV, so here at least TP 2."""
    plan = make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=_gpu(LLAMA3_8B_WEIGHTS),
                               kv_dtype="bf16", mem_util=1.0))
    assert "use TP 2 (the smallest TP" in _weights_note(plan)


def test_params_override_rescales_the_active_parameters_too() -> None:
    """--params 47B on Mixtral (46.7 B counted, 12.9 B active) scales the active count by
    the same ratio: prefill FLOPs come from active parameters, not the stored total."""
    m = load_model("mixtral-8x7b")
    plan = make_plan(PlanInput(model=m, gpu=find_gpu("h200"), kv_dtype="bf16",
                               params_override=47_000_000_000))
    assert plan.params == 47_000_000_000
    assert plan.active_params == int(47_000_000_000 * 12_879_925_248 / 46_702_792_704)
    assert plan.prefill_saving["prefill_flops_p50"] == 2.0 * plan.active_params * 2048


def test_a_config_counting_absurd_parameters_is_refused() -> None:
    """Each field within its bound can still multiply to 3.4e15 parameters (four layers
    of 2^24-wide MLPs): refused as no real model, not planned as petabytes of weights."""
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 1 << 24,
           "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 1 << 24, "vocab_size": 32000}
    with pytest.raises(PlanError, match="not a real model's config"):
        make_plan(PlanInput(model=spec_from_config(cfg), gpu=find_gpu("h100"),
                            kv_dtype="bf16"))


def test_the_checkpoint_kv_note_only_when_the_plan_follows_it() -> None:
    """The note that vLLM's auto KV dtype follows the checkpoint's FP8 KV belongs to a plan
    in that dtype; planned in bf16 (--kv-dtype bf16) it would misdescribe the numbers."""
    cfg = {**LLAMA_8B, "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
    m = spec_from_config(cfg)
    assert m.checkpoint_kv_dtype == "fp8_e4m3"

    def noted(kv_dtype: str) -> bool:
        plan = make_plan(PlanInput(model=m, gpu=find_gpu("h100"), kv_dtype=kv_dtype,
                                   weights_dtype="fp8"))
        return any("--kv-cache-dtype auto" in n for n in plan.notes)

    assert noted("fp8_e4m3") and not noted("bf16")


@pytest.mark.parametrize(("page", "block"), [(16, 256), (96, 192), (512, 512)])
def test_default_kvtier_block_is_whole_engine_pages(page: int, block: int) -> None:
    """Without --tokens-per-block the kvtier block is about 256 tokens in whole engine
    pages (the connector stores whole pages): 192 for 96-token pages, one 512-token page;
    a flat 256 would size the daemon's blocks for a block the connector never makes."""
    plan = make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=find_gpu("h100"),
                               kv_dtype="bf16", block_tokens=page))
    assert plan.kvtier_block_tokens == block


@pytest.mark.parametrize("share", [-0.01, 1.01])
def test_prefix_share_outside_zero_to_one_is_refused(share: float) -> None:
    """--prefix-share is a share of prompt tokens: above 1 the plan saved more prefill than
    there is."""
    with pytest.raises(PlanError, match="--prefix-share"):
        make_plan(PlanInput(model=load_model("llama-3-8b"), gpu=find_gpu("h100"),
                            kv_dtype="bf16", prefix_share=share))
