"""Taking the samples: live scrapes some seconds apart, or saved files in order."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.config import HttpConfig, http_base_url
from kvtier.doctor.engine import EngineSample, merge, parse_engine
from kvtier.doctor.errors import DoctorError
from kvtier.doctor.sources import is_url, read_text
from kvtier.doctor.stats import KVTierStats, parse_stats

DEFAULT_INTERVAL_S = 5.0


def stats_url(base: str) -> str:
    """The /v1/stats endpoint of the daemon at HTTP base URL ``base``."""
    return base.rstrip("/") + "/v1/stats"


DEFAULT_STATS_URL = stats_url(http_base_url(HttpConfig().host, HttpConfig().port))
"""The stats of a daemon on the default address, what the configuration's defaults give."""


@dataclass(frozen=True, slots=True)
class Request:
    """What to read: lists of URLs or files for each source, and the sampling plan.
    ``stats_from``: what set the stats address, named when they cannot be read."""

    stats: tuple[str, ...] = (DEFAULT_STATS_URL,)
    stats_explicit: bool = False
    stats_from: str = ""
    engine: tuple[str, ...] = ()
    gpu: tuple[str, ...] = ()
    samples: int = 2
    interval_s: float | None = None


@dataclass(slots=True)
class Collected:
    """The samples read, oldest first, and notes about what could not be used."""

    engine: list[EngineSample] = field(default_factory=list)
    stats: list[KVTierStats] = field(default_factory=list)
    interval_s: float | None = None
    notes: list[str] = field(default_factory=list)


def _check_refs(refs: tuple[str, ...], flag: str) -> None:
    if len(refs) > 1 and any(is_url(r) for r in refs):
        raise DoctorError(f"{flag}: give one URL (sampled --samples times) or files, "
                          "not several URLs")


def _plan(refs: tuple[str, ...], samples: int) -> list[str]:
    """The reference to read at each sample: a URL every time, or each file once."""
    if refs and is_url(refs[0]):
        return [refs[0]] * samples
    return list(refs)


def _engine(ref: str) -> EngineSample:
    sample = parse_engine(read_text(ref, "engine metrics"), ref)
    if not sample.has_engine_metrics:
        raise DoctorError(f"no vLLM metrics in {ref} (looked for vllm:num_requests_running, "
                          "vllm:kv_cache_usage_perc, ...): is it the engine's /metrics?")
    return sample


def _stats(ref: str, named_by: str) -> KVTierStats:
    """One stats sample; an address that gives none is said with what set it."""
    try:
        return parse_stats(read_text(ref, "kvtier stats"), ref)
    except DoctorError as exc:
        if named_by and is_url(ref):
            raise DoctorError(f"{exc}; {named_by}") from None
        raise


def collect(req: Request, sleep: Callable[[float], None] = time.sleep) -> Collected:
    """Read every sample; DoctorError when an explicitly named source is unreadable."""
    for refs, flag in ((req.stats, "--stats"), (req.engine, "--engine-metrics"),
                       (req.gpu, "--gpu-metrics")):
        _check_refs(refs, flag)
    if req.samples < 1:
        raise DoctorError(f"--samples must be at least 1, got {req.samples}")
    stats_refs = req.stats
    if not req.stats_explicit and req.engine and not is_url(req.engine[0]):
        stats_refs = ()  # saved engine files: a live daemon's stats would not match them
    live = any(r and is_url(r[0]) for r in (stats_refs, req.engine, req.gpu))
    n = req.samples if live else 1
    plans = {"stats": _plan(stats_refs, n), "engine": _plan(req.engine, n),
             "gpu": _plan(req.gpu, n)}
    steps = max(len(p) for p in plans.values())
    out = Collected()
    stats_ok = True
    interval = req.interval_s if req.interval_s is not None else DEFAULT_INTERVAL_S
    gpu: list[EngineSample] = []
    for i in range(steps):
        if i and live:
            sleep(interval)
        if stats_ok and i < len(plans["stats"]):
            try:
                out.stats.append(_stats(plans["stats"][i], req.stats_from))
            except DoctorError as exc:
                if req.stats_explicit or not req.engine:
                    raise
                stats_ok = False
                out.notes.append(f"{exc}; diagnosing from the engine's metrics alone")
        if i < len(plans["engine"]):
            out.engine.append(_engine(plans["engine"][i]))
        if i < len(plans["gpu"]):
            gpu.append(parse_engine(read_text(plans["gpu"][i], "GPU metrics"),
                                    plans["gpu"][i]))
    if gpu and out.engine:
        out.engine = [merge(e, gpu[min(i, len(gpu) - 1)]) for i, e in enumerate(out.engine)]
    out.interval_s = _interval(req, out, interval)
    return out


def _interval(req: Request, got: Collected, default: float) -> float | None:
    """Seconds between samples: as given, from the daemon's uptime, or the default."""
    if max(len(got.engine), len(got.stats)) < 2:
        return None
    if req.interval_s is not None:
        return req.interval_s
    ups = [s.uptime_s for s in got.stats]
    if len(ups) >= 2 and ups[-1] is not None and ups[-2] is not None and ups[-1] > ups[-2]:
        return ups[-1] - ups[-2]
    return default
