"""Payload codecs for frames leaving the node (Redis today, any remote tier tomorrow).

KV blocks are fp16/bf16 tensors. Their low (mantissa) bytes look random, so a general
compressor run on the raw bytes gains almost nothing (lz4 ratio ~1.00). Splitting the bytes
of each element into planes ("byte shuffle") puts the sign/exponent bytes together, which
do compress; zstd then gains 15-45% and lz4 somewhat less. ``AutoCodec`` samples blocks and
keeps a codec only while it pays for itself, so a deployment never pays CPU for nothing.

Wire format of an encoded payload (the frame header carries the codec id and ``raw_len``):

- ``NONE``: the raw bytes.
- ``LZ4``: an lz4 block without a size prefix (the size is the frame's ``raw_len``).
- ``SHUFFLE_LZ4`` / ``SHUFFLE_ZSTD``: ``u8 elem_bytes``, then per plane ``u8 mode``
  (0 stored raw, 1 compressed) and ``u32 length``, then the plane blobs in order, then the
  ``raw_len % elem_bytes`` tail bytes unshuffled. Plane j holds byte j of each of the
  ``raw_len // elem_bytes`` whole elements. Carrying ``elem_bytes`` makes a payload
  decodable without knowing the layout that produced it.

Codecs never raise for bad input with a generic exception: decoding errors become
``FrameError`` so the caller treats them like any other failed frame (a miss). A payload
is never decoded into more memory than its ``raw_len`` calls for: ``max_encoded_len`` says
how long a payload can be, and a zstd plane that declares another size than its plane's
is refused before it is decompressed (a few KiB can declare GiBs).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field

import numpy as np

from kvtier.errors import ConfigError, FrameError
from kvtier.frame import Codec

try:  # lz4 ships with the redis extra; NONE works without it
    import lz4.block as _lz4
except ImportError:  # pragma: no cover - exercised only without the extra
    _lz4 = None

try:  # optional: only SHUFFLE_ZSTD needs it
    import zstandard as _zstd
except ImportError:  # pragma: no cover
    # A module or None: every use is behind available()/_require(), which test for None.
    _zstd = None  # type: ignore[assignment]

ZSTD_LEVEL = 1  # level 1: ~all of zstd's gain on KV planes at several hundred MB/s
# The largest window a zstd plane may ask the decoder for. kvtier writes each plane in one
# call, so zstd sizes the window to the plane (at most 512 KiB at level 1); 8 MiB admits
# any level up to 19.
ZSTD_MAX_WINDOW = 8 << 20
_MAX_ELEM_BYTES = 8

_CONFIG_NAMES: dict[str, Codec | None] = {
    "none": Codec.NONE,
    "lz4": Codec.LZ4,
    "shuffle-lz4": Codec.SHUFFLE_LZ4,
    "shuffle-zstd": Codec.SHUFFLE_ZSTD,
    "auto": None,
}


def available(codec: Codec) -> bool:
    """Whether this process can encode and decode ``codec`` (its library is installed)."""
    if codec in (Codec.LZ4, Codec.SHUFFLE_LZ4):
        return _lz4 is not None
    if codec is Codec.SHUFFLE_ZSTD:
        return _zstd is not None
    return True


def from_config(name: str) -> Codec | None:
    """Map a ``redis.codec`` config string to a Codec (None means ``auto``).

    Raises ConfigError when the name is unknown or its library is not installed, so a
    misconfiguration is reported at start, not as failed writes later.
    """
    if name not in _CONFIG_NAMES:
        raise ConfigError(f"unknown codec {name!r}: use one of {', '.join(_CONFIG_NAMES)}")
    codec = _CONFIG_NAMES[name]
    if codec is not None and not available(codec):
        lib = "zstandard" if codec is Codec.SHUFFLE_ZSTD else "lz4"
        raise ConfigError(f"codec {name!r} needs the {lib!r} package: pip install {lib}")
    return codec


# --- byte shuffle -------------------------------------------------------------------------

_PLANE = struct.Struct("<BI")  # per plane: stored raw (0) or compressed (1), stored length
_RAW, _PACKED = 0, 1
_MIN_PLANE_GAIN = 0.02         # keep a plane compressed only if it saves at least 2%


def max_encoded_len(codec: Codec, raw_len: int) -> int:
    """The longest payload kvtier writes with ``codec`` for ``raw_len`` bytes: a frame that
    claims a longer one is corrupt, and a reader refuses it before allocating a buffer of
    the length it claims. LZ4: ``LZ4_compressBound``. Shuffled: the element width, one
    plane table entry per plane (at most ``_MAX_ELEM_BYTES``), then planes that are never
    longer than stored raw (a plane stays compressed only when that saves
    ``_MIN_PLANE_GAIN``), then the tail."""
    if codec is Codec.NONE:
        return raw_len
    if codec is Codec.LZ4:
        return raw_len + raw_len // 255 + 16
    return 1 + _MAX_ELEM_BYTES * _PLANE.size + raw_len


def split_planes(data: memoryview | bytes, elem_bytes: int) -> tuple[list[np.ndarray], bytes]:
    """Byte planes of ``data`` (plane j = byte j of every element) and the leftover tail."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % elem_bytes
    grid = raw[:whole].reshape(-1, elem_bytes)
    return [np.ascontiguousarray(grid[:, j]) for j in range(elem_bytes)], raw[whole:].tobytes()


def _compress(codec: Codec, plane: np.ndarray) -> bytes:
    if codec is Codec.SHUFFLE_LZ4:
        return _lz4.compress(plane, store_size=False)
    return _zstd_c().compress(plane.data)


def _decompress(codec: Codec, blob: memoryview, size: int) -> bytes:
    if codec is Codec.SHUFFLE_LZ4:
        return _lz4.decompress(blob, uncompressed_size=size)
    # python-zstandard allocates what a frame declares and ignores max_output_size then:
    # a declared size other than the plane's is refused first (kvtier writes none, -1)
    declared = _zstd.frame_content_size(blob)
    if declared not in (-1, size):
        raise FrameError(f"zstd plane declares {declared} bytes, expected {size}")
    return _zstd_d().decompress(blob, max_output_size=size)


def _encode_shuffled(codec: Codec, data: memoryview | bytes, elem_bytes: int) -> bytes:
    """Each plane compressed on its own (stored raw when that does not pay): fp16/bf16
    low-mantissa planes are noise, so compressing them separately keeps the compressor's
    statistics clean for the exponent plane and skips work on the noise at decode."""
    planes, tail = split_planes(data, elem_bytes)
    heads, blobs = [bytes((elem_bytes,))], []
    for plane in planes:
        packed = _compress(codec, plane)
        if len(packed) <= (1 - _MIN_PLANE_GAIN) * plane.nbytes:
            heads.append(_PLANE.pack(_PACKED, len(packed)))
            blobs.append(packed)
        else:
            heads.append(_PLANE.pack(_RAW, plane.nbytes))
            blobs.append(plane.tobytes())
    return b"".join([*heads, *blobs, tail])


def _decode_shuffled(codec: Codec, data: memoryview, raw_len: int, out: np.ndarray) -> None:
    """Inverse of ``_encode_shuffled``: each plane lands straight in its strided slot of
    ``out`` (a uint8 array of ``raw_len``), so un-shuffling costs no extra pass."""
    if len(data) < 1 or not 1 <= data[0] <= _MAX_ELEM_BYTES:
        raise FrameError("shuffled payload lacks a valid element width")
    elem_bytes = data[0]
    whole = raw_len - raw_len % elem_bytes
    count = whole // elem_bytes
    pos = 1 + elem_bytes * _PLANE.size
    if len(data) < pos:
        raise FrameError("shuffled payload truncated in its plane table")
    grid = out[:whole].reshape(-1, elem_bytes)
    for j in range(elem_bytes):
        mode, size = _PLANE.unpack_from(data, 1 + j * _PLANE.size)
        blob = data[pos:pos + size]
        pos += size
        if len(blob) != size or mode not in (_RAW, _PACKED):
            raise FrameError("shuffled payload has a malformed plane")
        plane = blob if mode == _RAW else _decompress(codec, blob, count)
        if len(plane) != count:
            raise FrameError(f"plane {j} holds {len(plane)} bytes, expected {count}")
        grid[:, j] = np.frombuffer(plane, dtype=np.uint8)
    if len(data) - pos != raw_len - whole:
        raise FrameError("shuffled payload tail length mismatch")
    out[whole:] = np.frombuffer(data[pos:], dtype=np.uint8)


# --- compressors (thread-safe: zstd contexts are per thread) --------------------------------

_local = threading.local()


def _zstd_c() -> _zstd.ZstdCompressor:
    ctx: _zstd.ZstdCompressor | None = getattr(_local, "zc", None)
    if ctx is None:
        ctx = _local.zc = _zstd.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=False)
    return ctx


def _zstd_d() -> _zstd.ZstdDecompressor:
    ctx: _zstd.ZstdDecompressor | None = getattr(_local, "zd", None)
    if ctx is None:
        ctx = _local.zd = _zstd.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    return ctx


def _require(codec: Codec) -> None:
    if not available(codec):
        raise FrameError(f"codec {codec.name} is not available in this process")


def encode(codec: Codec, data: memoryview | bytes, elem_bytes: int = 2) -> bytes:
    """Encode ``data`` with ``codec``; the result is what goes into the frame payload.

    ``elem_bytes`` is the element width used by the shuffle codecs (2 for fp16/bf16).
    CPU-heavy for everything but NONE: callers on an event loop run it in a thread
    (lz4, zstd and numpy release the GIL for the bulk of the work).
    """
    _require(codec)
    if codec is Codec.NONE:
        return bytes(data)
    if codec is Codec.LZ4:
        return _lz4.compress(data, store_size=False)
    if not 1 <= elem_bytes <= _MAX_ELEM_BYTES:
        raise ValueError(f"elem_bytes must be 1..{_MAX_ELEM_BYTES}, got {elem_bytes}")
    return _encode_shuffled(codec, data, elem_bytes)


def decode(codec: Codec, data: memoryview | bytes, raw_len: int,
           out: memoryview | None = None) -> memoryview | bytes:
    """Decode a payload of ``raw_len`` decoded bytes; into ``out[:raw_len]`` when given.

    Returns ``out[:raw_len]`` when ``out`` is given, else new bytes. NONE and the shuffle
    codecs write straight into ``out`` (one pass); LZ4 decompresses to a scratch buffer
    first (the lz4 binding cannot write into a caller's buffer). Raises FrameError when
    the payload does not decode to exactly ``raw_len`` bytes.
    """
    _require(codec)
    if out is not None:
        if out.format != "B" or out.ndim != 1:
            out = out.cast("B")
        if len(out) < raw_len:
            raise ValueError(f"output buffer of {len(out)} bytes is smaller than {raw_len}")
    try:
        if codec is Codec.NONE:
            if len(data) != raw_len:
                raise FrameError(f"payload has {len(data)} bytes, expected {raw_len}")
            if out is None:
                return bytes(data)
            dst = np.frombuffer(out, dtype=np.uint8, count=raw_len)
            np.copyto(dst, np.frombuffer(data, dtype=np.uint8))  # releases the GIL
            return out[:raw_len]
        if codec is Codec.LZ4:
            plain = _lz4.decompress(data, uncompressed_size=raw_len)
            if len(plain) != raw_len:
                raise FrameError(f"lz4 payload decoded to {len(plain)} bytes, not {raw_len}")
            if out is None:
                return plain
            out[:raw_len] = plain
            return out[:raw_len]
        if out is None:
            result = np.empty(raw_len, dtype=np.uint8)
            _decode_shuffled(codec, memoryview(data).cast("B"), raw_len, result)
            return result.tobytes()
        dst = np.frombuffer(out, dtype=np.uint8, count=raw_len)
        _decode_shuffled(codec, memoryview(data).cast("B"), raw_len, dst)
        return out[:raw_len]
    except FrameError:
        raise
    except Exception as exc:  # lz4.block.LZ4BlockError, zstd.ZstdError, ValueError
        raise FrameError(f"{codec.name} payload does not decode: {exc}") from exc


# --- auto ---------------------------------------------------------------------------------

AUTO_CANDIDATES: tuple[Codec, ...] = (Codec.SHUFFLE_ZSTD, Codec.SHUFFLE_LZ4, Codec.LZ4)


@dataclass(slots=True)
class AutoCodec:
    """Picks a codec by sampling: keeps one only while it shrinks blocks by >= ``min_gain``.

    Every ``sample_every``-th block (and every block until a first sample has finished) is
    encoded with every available candidate; the smallest result wins if it saves at least
    ``min_gain`` of the raw size, otherwise the choice becomes NONE. Between samples the
    chosen codec is used and its achieved ratio is tracked; once its running average gain
    falls below ``min_gain`` the choice drops to NONE until the next sample. Thread-safe
    (encodes run in worker threads).
    """

    sample_every: int = 16
    min_gain: float = 0.10
    candidates: tuple[Codec, ...] = AUTO_CANDIDATES
    current: Codec = Codec.NONE
    blocks: int = 0
    samples: int = 0
    raw_bytes: int = 0
    encoded_bytes: int = 0
    _avg_ratio: float = 1.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.candidates = tuple(c for c in self.candidates if available(c))

    @property
    def ratio(self) -> float:
        """raw / encoded over every block this instance encoded (1.0 before any)."""
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0

    def encode(self, data: memoryview | bytes, elem_bytes: int = 2) -> tuple[Codec, bytes]:
        """Encode one block with the current choice (sampling first when it is due)."""
        with self._lock:  # until a first sample finished, every block samples: threads
            # encoding in parallel at start must not write raw while the first one decides
            sample = self.blocks % self.sample_every == 0 or self.samples == 0
            self.blocks += 1
            codec = self.current
        n = len(data)
        if sample:
            codec, body = self._sample(data, elem_bytes)
        else:
            body = encode(codec, data, elem_bytes)
            if codec is not Codec.NONE and n:
                with self._lock:
                    self._avg_ratio = 0.75 * self._avg_ratio + 0.25 * (len(body) / n)
                    if self._avg_ratio > 1.0 - self.min_gain:
                        self.current = Codec.NONE
        if codec is not Codec.NONE and len(body) >= n:
            codec, body = Codec.NONE, bytes(data)  # never store an expanded block
        with self._lock:
            self.raw_bytes += n
            self.encoded_bytes += len(body)
        return codec, body

    def _sample(self, data: memoryview | bytes, elem_bytes: int) -> tuple[Codec, bytes]:
        n = len(data)
        best, best_body = Codec.NONE, b""
        for cand in self.candidates:
            body = encode(cand, data, elem_bytes)
            if best is Codec.NONE or len(body) < len(best_body):
                best, best_body = cand, body
        gains = best is not Codec.NONE and n > 0 and len(best_body) <= (1 - self.min_gain) * n
        with self._lock:
            self.samples += 1
            self.current = best if gains else Codec.NONE
            self._avg_ratio = len(best_body) / n if gains else 1.0
        return (best, best_body) if gains else (Codec.NONE, bytes(data))
