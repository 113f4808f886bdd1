"""Helpers shared by the vLLM end-to-end tests, and a runner for engines in subprocesses.

Tiny random Llama: no download; ``initializer_range=0.3`` so greedy outputs depend on the
context (with the default 0.02 every prompt yields nearly the same tokens and equality
checks prove nothing). The CPU attention backend needs a supported head size (32).

As a script (``python tests/e2e/vllm_engine.py SPEC.json OUT.json``) it runs one engine
and a list of phases, each a list of prompts generated together, and writes the tokens
and ``num_cached_tokens`` of every request: this is how tests get a second engine
process, an engine in vLLM's default multiprocess mode, and a baseline without kvtier.
Beside them it writes the connector's counters and, per phase, what the scheduler did
(``SchedulerWatch``: preemptions, failed loads, kvtier loads).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvtier.layout import KVLayout

BLOCK_SIZE = 32          # vLLM page size
TOKENS_PER_BLOCK = 64    # kvtier block: two vLLM pages, so page<->block mapping is exercised


def engine_layout(layout: KVLayout) -> KVLayout:
    """``layout`` as a CPU engine of these tests keys it: its attention kernel's page
    format (``geometry.with_engine_page_format``) is part of the namespace."""
    from kvtier.connectors.vllm.geometry import with_engine_page_format

    return with_engine_page_format(layout, None, BLOCK_SIZE)
VOCAB = 1000
MAX_TOKENS = 12

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def build_tiny_llama(path: Path, *, layers: int = 2, kv_heads: int = 2,
                     head_dim: int = 32, seed: int = 0) -> Path:
    """A random LlamaForCausalLM (hidden 64, 4 heads; by default 2 layers, 2 KV heads,
    head_dim 32); ``seed`` draws its weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, initializer_range=0.3,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_swa(path: Path, *, window: int = 48, seed: int = 0) -> Path:
    """A random Gemma3ForCausalLM (hidden 64, 4 heads, 2 KV heads, head_dim 32) whose
    first two layers attend to a sliding window of ``window`` tokens and third to every
    token (Gemma 3, gpt-oss and Ministral mix them so); ``seed`` draws its weights."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, query_pre_attn_scalar=32,
                           max_position_embeddings=4096, initializer_range=0.3,
                           sliding_window=window,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention"])
    torch.manual_seed(seed)
    Gemma3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_mla(path: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """A random DeepseekV2ForCausalLM with multi-head latent attention (hidden 64, 4
    heads; the latent is 512 + 64 rope = 576 wide and v_head_dim 512, the one geometry
    vLLM's CPU MLA kernels take; every layer dense: vLLM's CPU MoE router needs grouped
    top-k settings a tiny config does not need); ``seed`` draws its weights."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                           first_k_dense_replace=layers, kv_lora_rank=512,
                           q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=512,
                           qk_nope_head_dim=32, max_position_embeddings=4096,
                           initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_eagle3(path: Path, *, aux_layers: tuple[int, ...] = (1, 2, 4),
                      seed: int = 0) -> Path:
    """A random EAGLE3 draft (one Llama layer on the target's hidden size 64) for the tiny
    Llama of at least ``max(aux_layers) + 1`` layers: vLLM's speculative decoding with a
    draft model of its own weights and config, no download."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hidden, heads, kv_heads, head_dim, inter = 64, 4, 2, 32, 128
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=1, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = VOCAB
    cfg.eagle_aux_hidden_state_layer_ids = list(aux_layers)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    layer = "midlayer."
    weights = {
        f"{layer}self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        f"{layer}self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{layer}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}mlp.down_proj.weight": rand(hidden, inter),
        f"{layer}input_layernorm.weight": torch.ones(hidden),
        f"{layer}hidden_norm.weight": torch.ones(hidden),
        f"{layer}post_attention_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "fc.weight": rand(hidden, 3 * hidden),
        "lm_head.weight": rand(VOCAB, hidden),
    }
    save_file(weights, str(path / "model.safetensors"))
    return path


def engine_model_id(model_id: str, model: Path, dtype: str = "float32") -> str:
    """The model id the connector registers for ``model_id`` on an engine of ``model``
    (its weights fingerprint appended, ``model_fingerprint = "auto"``)."""
    from kvtier.weights import WEIGHTS_MARK, fingerprint

    return f"{model_id}{WEIGHTS_MARK}{fingerprint(str(model), dtype=dtype)}"


def prompt(seed: int, n: int) -> list[int]:
    """Deterministic token ids in [1, VOCAB)."""
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def kv_transfer_config(socket: Path | str, **extra: Any) -> dict[str, Any]:
    """The KVTransferConfig fields of a kvtier-enabled engine.

    ``skip_slower_than_recompute`` is off unless a test turns it on: the tiny test model
    recomputes a 64-token block in well under a millisecond, about what reloading it costs,
    so on a loaded machine the measured comparison flips either way between runs and the
    tests asserting exact hit counts would be flaky (test_vllm_data_path turns it on).
    """
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_path": str(socket),
                                      "tokens_per_block": TOKENS_PER_BLOCK,
                                      "reconnect_min_s": 0.2, "reconnect_max_s": 1.0,
                                      "skip_slower_than_recompute": False, **extra},
    }


def make_llm(model: Path, transfer: dict[str, Any] | None, prefix_caching: bool = False,
             dtype: Literal["float32", "float16", "bfloat16"] = "float32",
             engine_args: dict[str, Any] | None = None) -> Any:
    """An engine as the issue prescribes (float32 unless ``dtype``, block 32, eager, no
    local prefix cache unless ``prefix_caching``). ``engine_args``: more ``LLM`` keyword
    arguments, or other values of these (e.g. ``num_gpu_blocks_override``,
    ``max_num_batched_tokens``, ``max_model_len``)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {"max_model_len": 4096, "block_size": BLOCK_SIZE,
                              "skip_tokenizer_init": True, **(engine_args or {})}
    if transfer is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    return LLM(model=str(model), dtype=dtype, enforce_eager=True,
               enable_prefix_caching=prefix_caching, seed=0, **kwargs)


def add_tiny_tokenizer(path: Path) -> Path:
    """A word-level tokenizer of ``VOCAB`` tokens saved beside the model in ``path``: what
    an engine that cannot skip its tokenizer (a pooling engine) loads; no download."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        vocab, unk_token="<unk>")), unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


def generate(llm: Any, prompts: list[list[int]], salts: list[str | None] | None = None,
             max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], int]]:
    """Greedy outputs and num_cached_tokens of each prompt, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    salts = salts or [None] * len(prompts)
    inputs = []
    for p, salt in zip(prompts, salts, strict=True):
        tp = TokensPrompt(prompt_token_ids=p)
        if salt is not None:
            tp["cache_salt"] = salt
        inputs.append(tp)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(inputs, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]


def embed(llm: Any, prompts: list[list[int]]) -> list[tuple[list[float], int]]:
    """A pooling engine's embedding of each prompt (its first 64 values) and
    num_cached_tokens, in order."""
    from vllm.inputs import TokensPrompt

    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    return [([float(v) for v in o.outputs.embedding[:64]],
             int(getattr(o, "num_cached_tokens", 0) or 0)) for o in outs]


def phase_prompts(phase: dict[str, Any], results: list[Any],
                  prompts: list[list[list[int]]]) -> list[list[int]]:
    """A phase's prompts: given, or ``{"continue": {"phase": i, "extra": [...]}}`` = each
    prompt of phase ``i`` followed by its output and ``extra`` (a next chat turn)."""
    cont = phase.get("continue")
    if cont is None:
        return phase["prompts"]
    i = cont["phase"]
    return [p + out + cont["extra"] for p, (out, _) in zip(prompts[i], results[i], strict=True)]


def abort_reloads(llm: Any, prompts: list[list[int]],
                  max_tokens: int) -> list[tuple[list[int], int]]:
    """Run ``prompts`` step by step and abort every request that comes back from a
    preemption to an asynchronous load of its own saved KV, while it waits for that load
    (the in-process engine only); an aborted request's result is ``([], -1)``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for name, p in zip(ids, prompts, strict=True):
        engine.add_request(name, TokensPrompt(prompt_token_ids=p), params)
    done: dict[str, tuple[list[int], int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids),
                                        int(out.num_cached_tokens or 0))
        for req in list(scheduler.requests.values()):
            rid = next((r for r in ids if req.request_id == r
                        or req.request_id.startswith(f"{r}-")), None)
            if rid is not None and req.num_preemptions > 0 and \
                    req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                engine.abort_request([rid])
                done[rid] = ([], -1)
    return [done[r] for r in ids]


def connector_counters(llm: Any) -> dict[str, Any]:
    """The scheduler-side connector's counters (in-process engine core only)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    side = getattr(connector, "_scheduler", None)
    if side is None:
        return {}
    return {**side.counters, "prefill_tokens_per_s": side.recompute.prefill_tokens_per_s}


def lose_blocks_at_load(blocks: list[int], rank: int = 0) -> None:
    """Once: right after the scheduler allocates the next request that loads from kvtier,
    delete kvtier blocks ``blocks[0]:blocks[1]`` of its prompt (TP rank ``rank``'s shards)
    from the daemon, as an eviction, a restart or a checksum failure between its lookup
    and its load would (the in-process engine only)."""
    from kvtier.connectors.vllm.scheduler import SchedulerSide

    from kvtier.keys import block_keys

    original = SchedulerSide.update_state_after_alloc

    def hooked(self: Any, request: Any, blocks_: Any, num_external_tokens: int) -> None:
        original(self, request, blocks_, num_external_tokens)
        if num_external_tokens > 0:
            setattr(SchedulerSide, "update_state_after_alloc", original)  # noqa: B010 (once)
            ns = self.link.namespace(None, rank)
            keys = block_keys(ns, list(request.all_token_ids))
            self.link.call(lambda c: c.delete(ns, keys[blocks[0]:blocks[1]]), 0)

    setattr(SchedulerSide, "update_state_after_alloc", hooked)  # noqa: B010 (a test hook)


def slow_saves(seconds: float) -> None:
    """From now on every save of the connector waits ``seconds`` before it copies pages (a
    saver slower than the engine's steps): saves are still running when vLLM preempts or
    finishes their request, or looks up the blocks they hold (the in-process engine only)."""
    import time

    from kvtier.connectors.vllm.transfers import SaveRequest

    original = SaveRequest.copy

    def delayed(self: Any, stream: Any) -> None:
        time.sleep(seconds)
        original(self, stream)

    setattr(SaveRequest, "copy", delayed)  # noqa: B010 (a test hook)


def stall_daemon_at_load(pid: int, seconds: float) -> None:
    """Once: right after the next load copies its first layer, SIGSTOP the daemon ``pid``
    and SIGCONT it ``seconds`` later (a daemon that stops answering mid-load)."""
    import signal
    import threading

    from kvtier.connectors.vllm.transfers import LoadBatch

    original = LoadBatch.load_layer

    def load_layer(self: Any, layer: int, stream: Any) -> None:
        original(self, layer, stream)
        if layer == 0:
            setattr(LoadBatch, "load_layer", original)  # noqa: B010 (once)
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()

    setattr(LoadBatch, "load_layer", load_layer)  # noqa: B010 (a test hook)


class SchedulerWatch:
    """Counts, per phase, what vLLM's scheduler did that the outputs do not show: its
    preemptions (``Scheduler._preempt_request``: pages freed, the request recomputed from
    its first token when it runs again), split by whether the request was still in its
    prefill; the pages a KV connector reported as failed loads (``invalid_blocks``, vLLM
    recomputes them); and, with kvtier's connector, the admissions for which it planned
    a load (``loads``, ``loaded_tokens``), and its admissions of requests that had been
    preempted (``resumed``; an asynchronous load admits twice: to load, then to run) with
    what kvtier loaded for those. The in-process engine core only (the default
    multiprocess one runs in another process)."""

    def __init__(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        self.phases: list[dict[str, int]] = []
        self._now = self._zero()
        original = Scheduler._preempt_request
        watch = self

        def preempt(sched: Any, request: Any, *args: Any, **kwargs: Any) -> None:
            watch._now["preemptions"] += 1
            if request.num_computed_tokens < request.num_prompt_tokens:
                watch._now["preempted_in_prefill"] += 1
            else:
                watch._now["preempted_in_decode"] += 1
            original(sched, request, *args, **kwargs)

        setattr(Scheduler, "_preempt_request", preempt)  # noqa: B010 (a test hook)
        invalid = Scheduler._handle_invalid_blocks

        def handle_invalid(sched: Any, invalid_block_ids: set[int], *args: Any) -> Any:
            watch._now["invalid_blocks"] += len(invalid_block_ids)
            return invalid(sched, invalid_block_ids, *args)

        setattr(Scheduler, "_handle_invalid_blocks", handle_invalid)  # noqa: B010
        from kvtier.connectors.vllm.scheduler import SchedulerSide

        alloc = SchedulerSide.update_state_after_alloc

        def after_alloc(side: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens > 0:
                watch._now["loads"] += 1
                watch._now["loaded_tokens"] += num_external_tokens
            if request.num_preemptions > 0:
                watch._now["resumed"] += 1
                if num_external_tokens > 0:
                    watch._now["resumed_with_load"] += 1
                    watch._now["resumed_loaded_tokens"] += num_external_tokens
            alloc(side, request, blocks, num_external_tokens)

        setattr(SchedulerSide, "update_state_after_alloc", after_alloc)  # noqa: B010

    @staticmethod
    def _zero() -> dict[str, int]:
        return dict.fromkeys(("preemptions", "preempted_in_prefill", "preempted_in_decode",
                              "invalid_blocks", "loads", "loaded_tokens", "resumed",
                              "resumed_with_load", "resumed_loaded_tokens"), 0)

    def end_phase(self) -> None:
        self.phases.append(self._now)
        self._now = self._zero()


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    watch = SchedulerWatch()
    # worker-side hooks: here, and in the TP workers vLLM starts (they inherit the variable)
    os.environ[WORKER_HOOKS_ENV] = json.dumps({k: spec.get(k) for k in WORKER_HOOKS})
    install_worker_hooks()
    llm = make_llm(Path(spec["model"]), spec.get("transfer"), spec.get("prefix_caching", False),
                   spec.get("dtype", "float32"), spec.get("engine_args"))
    results: list[Any] = []
    prompts: list[list[list[int]]] = []
    for phase in spec["phases"]:
        if "lose_blocks_at_load" in phase:   # [lo, hi], or {"blocks": [lo, hi], "rank": r}
            lost = phase["lose_blocks_at_load"]
            if isinstance(lost, dict):
                lose_blocks_at_load(lost["blocks"], lost.get("rank", 0))
            else:
                lose_blocks_at_load(lost)
        if "slow_saves_s" in phase:
            slow_saves(phase["slow_saves_s"])
        if "stall_daemon_at_load" in phase:
            stall_daemon_at_load(**phase["stall_daemon_at_load"])
        prompts.append(phase_prompts(phase, results, prompts))
        if phase.get("abort_reloads"):
            results.append(abort_reloads(llm, prompts[-1], phase.get("max_tokens", MAX_TOKENS)))
        elif phase.get("embed"):
            results.append(embed(llm, prompts[-1]))
        else:
            results.append(generate(llm, prompts[-1], phase.get("salts"),
                                    phase.get("max_tokens", MAX_TOKENS)))
        watch.end_phase()
    Path(out_path).write_text(json.dumps(results))
    Path(out_path + ".connector.json").write_text(json.dumps(connector_counters(llm)))
    Path(out_path + ".engine.json").write_text(json.dumps(watch.phases))
    # Stop the engine-core process (multiprocess mode) before leaving; then skip vLLM's
    # slow interpreter teardown, the results are on disk.
    llm.llm_engine.engine_core.shutdown(timeout=30)
    os._exit(0)


WORKER_HOOKS = ("spoil_loads", "record_pages")
WORKER_HOOKS_ENV = "KVTIER_TEST_WORKER_HOOKS"


def install_worker_hooks() -> None:
    """The ``worker_hooks`` a spec names (``spoil_loads``: {"salt", "from_block", "rank"};
    ``record_pages``: a directory), from ``WORKER_HOOKS_ENV``."""
    from tests.e2e.worker_hooks import record_pages, spoil_loads

    hooks = json.loads(os.environ.get(WORKER_HOOKS_ENV) or "{}")
    if hooks.get("spoil_loads"):
        spoil_loads(**hooks["spoil_loads"])
    if hooks.get("record_pages"):
        record_pages(hooks["record_pages"])


if __name__ == "__mp_main__":   # a TP worker started with "spawn" imports this file so
    install_worker_hooks()

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
