"""The codec table of bench_redis: each Redis codec's ratio and single-thread speed on
normal-distributed fp16/bf16 KV blocks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvtier import codec as codecs
from kvtier.frame import Codec

MiB = 1 << 20


@dataclass(slots=True)
class CodecRow:
    dtype: str
    codec: str
    ratio: float
    enc_mbs: float
    dec_mbs: float


def codec_table(block: int, blocks: int, repeat: int) -> list[CodecRow]:
    rows: list[CodecRow] = []
    for dtype in ("fp16", "bf16"):
        rng = np.random.default_rng(0)
        f = rng.standard_normal((blocks, block // 2)).astype(np.float32)
        arr = (f.astype(np.float16).view(np.uint16) if dtype == "fp16"
               else (f.view(np.uint32) >> 16).astype(np.uint16))
        data = [arr[i].view(np.uint8) for i in range(blocks)]
        raw = block * blocks
        out = memoryview(bytearray(block))
        for name in ("none", "lz4", "shuffle-lz4", "shuffle-zstd", "auto"):
            try:
                fixed = codecs.from_config(name)
            except Exception:
                continue  # library missing: leave the row out
            enc_t = dec_t = float("inf")
            encoded: list[tuple[Codec, bytes]] = []
            for _ in range(repeat):
                auto = codecs.AutoCodec()
                t0 = time.perf_counter()
                encoded = ([auto.encode(d) for d in data] if fixed is None
                           else [(fixed, codecs.encode(fixed, d)) for d in data])
                enc_t = min(enc_t, time.perf_counter() - t0)
                t0 = time.perf_counter()
                for c, body in encoded:
                    codecs.decode(c, body, block, out)
                dec_t = min(dec_t, time.perf_counter() - t0)
            size = sum(len(b) for _, b in encoded)
            rows.append(CodecRow(dtype, name, raw / size, raw / enc_t / MiB, raw / dec_t / MiB))
    return rows
