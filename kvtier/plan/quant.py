"""A checkpoint's ``quantization_config``, reduced to bits per weight for each part.

Weight-only methods (AWQ, GPTQ, bitsandbytes, compressed-tensors) store the linear layers
(attention, MLP, MoE experts) in few bits plus a scale (and a zero point) per group of
weights, and leave the embeddings, the LM head and the norms at the checkpoint's dtype.
gpt-oss's mxfp4 quantizes the MoE experts only: 4 bits and one 8-bit scale per 32 weights.
fp8 checkpoints count every weight at one byte. A method not known here is never guessed
(it is not bf16): the plan asks for ``--weights-dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.plan.fields import brief

MXFP4_BITS = 4 + 8 / 32
"""mxfp4: 4-bit elements and an 8-bit (E8M0) scale per block of 32."""
SCALE_BITS = 16
"""A group's scale (fp16 or bf16) in AWQ, GPTQ and integer compressed-tensors."""
BNB_BLOCK = 64
"""bitsandbytes' 4-bit block: one fp32 absmax per 64 weights (8 bits with double quant,
whose own fp32 scale covers 256 blocks)."""
_AWQ_GPTQ = frozenset({"awq", "awq_marlin", "gptq", "gptq_marlin", "marlin"})
FP8_METHODS = frozenset({"fp8", "fbgemm_fp8"})
"""Methods that store the linear layers' and experts' weights in one byte."""


@dataclass(frozen=True, slots=True)
class Quantization:
    """What a checkpoint's ``quantization_config`` says about the stored weights.

    ``linear_bits`` is bits per weight of the attention and MLP matrices with their group
    scales (None: the checkpoint's dtype), ``expert_bits`` of the MoE experts' (None: as
    ``linear_bits``), ``embed_bits`` of embeddings and norms (None: the checkpoint's dtype).
    ``problem``
    is set when the method is not modelled: the one-line PlanError the planner raises
    unless ``--weights-dtype`` says what the weights take.
    """

    method: str
    label: str
    linear_bits: float | None = None
    expert_bits: float | None = None
    embed_bits: float | None = None
    problem: str = ""


def _unknown(method: str, source: str, why: str) -> Quantization:
    return Quantization(method, method, problem=(
        f"{source}: quantization_config {why}, so the size of its weights is unknown "
        "(never assumed bf16); pass --weights-dtype (int4, int8, fp8, bf16: what a weight "
        "takes), with --params if the count differs"))


def _bits(q: dict[str, Any], keys: tuple[str, ...], default: int | None) -> int | None:
    """The first of ``keys`` set in ``q`` as an integer from 1 to 16, else ``default``
    (None: not usable)."""
    for key in keys:
        value = q.get(key)
        if value is not None:
            ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 16
            return value if ok else None
    return default


def _grouped(bits: int, group: object, scale_bits: float, zero_point: bool) -> float:
    """Bits per weight with one scale (and a ``bits``-bit zero point) per ``group``
    weights; a group of -1 or 0 is one per output channel: negligible."""
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        return float(bits)
    return bits + (scale_bits + (bits if zero_point else 0)) / group


def _awq_gptq(method: str, q: dict[str, Any], source: str) -> Quantization:
    bits = _bits(q, ("bits", "w_bit"), 4 if method == "marlin" else None)
    if bits is None:
        return _unknown(method, source, f"{method!r} gives no usable 'bits' "
                                        f"({brief(q.get('bits', q.get('w_bit')))})")
    group = q.get("group_size", q.get("q_group_size"))
    zero = method.startswith("gptq") or bool(q.get("zero_point", True))  # GPTQ stores qzeros
    name = method.removesuffix("_marlin")
    return Quantization(method, f"{name} int{bits}",
                        linear_bits=_grouped(bits, group, SCALE_BITS, zero))


def _bitsandbytes(method: str, q: dict[str, Any], source: str) -> Quantization:
    if q.get("load_in_4bit") is True:
        absmax = 8 / BNB_BLOCK + 32 / (BNB_BLOCK * 256) \
            if q.get("bnb_4bit_use_double_quant") is True else 32 / BNB_BLOCK
        kind = str(q.get("bnb_4bit_quant_type") or "fp4")
        return Quantization(method, f"bitsandbytes {kind}", linear_bits=4 + absmax)
    if q.get("load_in_8bit") is True:
        return Quantization(method, "bitsandbytes int8", linear_bits=8.0)
    return _unknown(method, source, "'bitsandbytes' sets neither load_in_4bit nor "
                                    "load_in_8bit")


def _compressed_tensors(method: str, q: dict[str, Any], source: str) -> Quantization:
    """The widest weights of ``config_groups`` (a mixed-precision checkpoint is counted at
    its widest: never less than it holds)."""
    best: tuple[float, str] | None = None
    groups = q.get("config_groups")
    for group in (groups.values() if isinstance(groups, dict) else ()):
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            continue
        bits = _bits(w, ("num_bits",), None)
        if bits is None:
            return _unknown(method, source, "'compressed-tensors' config_groups.*.weights."
                                            f"num_bits is {brief(w.get('num_bits'))}")
        is_float = w.get("type") == "float"
        scale = 8 if is_float and bits == 4 else SCALE_BITS  # nvfp4 scales are fp8
        grouped = w.get("strategy") in ("group", "tensor_group")
        total = _grouped(bits, w.get("group_size") if grouped else None, scale,
                         w.get("symmetric") is False)
        label = f"compressed-tensors {'fp' if is_float else 'int'}{bits}"
        if best is None or total > best[0]:
            best = (total, label)
    if best is None:
        return _unknown(method, source, "'compressed-tensors' has no config_groups.*.weights."
                                        "num_bits")
    return Quantization(method, best[1], linear_bits=best[0])


def read_quantization(cfg: dict[str, Any], source: str) -> Quantization | None:
    """The weights format of ``cfg['quantization_config']``; None when not quantized."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        return _unknown("?", source, f"is {brief(q)}, not an object")
    raw = q.get("quant_method")
    if raw is None and (q.get("load_in_4bit") is True or q.get("load_in_8bit") is True):
        raw = "bitsandbytes"  # configs written before quant_method existed
    if not isinstance(raw, str) or not raw:
        return _unknown("?", source, f"has no quant_method ({brief(raw)})")
    method = raw.strip().lower()
    if method in FP8_METHODS:
        # vLLM's Fp8Config quantizes LinearBase layers and experts only: the vocabulary
        # embedding and the LM head keep the checkpoint's 16-bit dtype
        return Quantization(method, "fp8", linear_bits=8.0, expert_bits=8.0)
    if method in _AWQ_GPTQ:
        return _awq_gptq(method, q, source)
    if method == "bitsandbytes":
        return _bitsandbytes(method, q, source)
    if method == "compressed-tensors":
        return _compressed_tensors(method, q, source)
    if method == "mxfp4":
        return Quantization(method, "mxfp4 experts", expert_bits=MXFP4_BITS)
    return _unknown(method, source, f"quant_method {raw!r} is not modelled")


def _modelopt_kv(q: dict[str, Any]) -> str:
    """vLLM's ``get_kv_cache_quant_algo_string`` for a ModelOpt config: ``kv_cache_scheme``
    (float, 8 bits, static: fp8; 4 bits: nvfp4) or ``kv_cache_quant_algo`` ("FP8",
    "NVFP4"), in ``quantization`` or at the top; "" when it names none it knows."""
    inner = q.get("quantization")
    inner = inner if isinstance(inner, dict) else q
    algo = (inner.get("kv_cache_scheme") or q.get("kv_cache_scheme")
            or inner.get("kv_cache_quant_algo") or q.get("kv_cache_quant_algo"))
    if isinstance(algo, dict):
        if algo.get("type") != "float":
            return ""
        if algo.get("num_bits") == 8 and algo.get("dynamic") is False:
            return "fp8_e4m3"
        return "nvfp4" if algo.get("num_bits") == 4 else ""
    if isinstance(algo, str):
        return {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}.get(algo.lower(), "")
    return ""


def kv_cache_dtype(cfg: dict[str, Any]) -> str:
    """The KV cache dtype vLLM's ``--kv-cache-dtype auto`` takes from the checkpoint's
    ``quantization_config`` ("" when it takes the model's dtype): ModelOpt's FP8 KV is
    fp8_e4m3 (vllm/utils/torch_utils.py ``resolve_kv_cache_dtype_string``), and a
    compressed-tensors ``kv_cache_scheme`` makes vLLM's Attention layer use fp8."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return ""
    method = q.get("quant_method")
    method = method.strip().lower().replace("_", "-") if isinstance(method, str) else ""
    producer = q.get("producer")
    if method.startswith("modelopt") or (
            isinstance(producer, dict) and producer.get("name") == "modelopt"):
        return _modelopt_kv(q)
    if method == "compressed-tensors" and q.get("kv_cache_scheme") is not None:
        return "fp8"
    return ""
