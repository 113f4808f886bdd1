"""`kvtier serve | stats | plan | doctor | replay | explain`.

Subcommands owned by other modules register themselves through an ``add_parser``
function; a subcommand whose optional dependencies are missing is still listed and says
what to install.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import sys
import time
import traceback
import urllib.error
import urllib.request
from typing import Any

from kvtier import __version__
from kvtier.errors import KVTierError

_PLUGGABLE = (
    ("kvtier.plan.cli", "plan"),
    ("kvtier.doctor.cli", "doctor"),
    ("kvtier.replay.cli", "replay"),
    ("kvtier.explain_cli", "explain"),
)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the node daemon in the foreground",
                       description="Run the kvtier daemon. Settings: TOML file < env "
                       "KVTIER_* < these flags.")
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--data-dir", help="data directory (nvme tier lives under it)")
    p.add_argument("--socket", help="control socket path")
    p.add_argument("--http-host", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="HTTP port (0 = pick a free one)")
    p.add_argument("--cpu-bytes", help="cpu tier (shared memory) size, e.g. 4GiB")
    p.add_argument("--nvme-bytes", help="nvme tier size, e.g. 64GiB (0 disables it)")
    p.add_argument("--nvme-path", help="nvme tier directory (default DATA_DIR/nvme)")
    p.add_argument("--nvme-direct", choices=("auto", "on", "off"), help="O_DIRECT use")
    p.add_argument("--eviction", choices=("adaptive", "lru", "lfu", "cost"), help="eviction policy")
    p.add_argument("--redis-url", help="enable the redis tier at this URL")
    p.add_argument("--redis-cluster", action="store_true", default=None,
                   help="the redis URL points at a Redis Cluster")
    p.add_argument("--redis-password", help="redis AUTH password")
    p.add_argument("--redis-codec", choices=("none", "lz4", "shuffle-lz4", "shuffle-zstd",
                                             "auto"), help="codec for frames sent to redis")
    p.add_argument("--redis-ttl", type=int, help="redis key TTL in seconds (0 = none)")
    p.add_argument("--redis-write-through", action="store_true", default=None,
                   help="write every put to redis too (not only blocks demoted from nvme)")
    p.add_argument("--log-level", help="debug, info, warning")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of a startup failure (default: one line)")
    p.set_defaults(func=_run_serve)


def _serve_overrides(a: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {
        "daemon.data_dir": a.data_dir, "daemon.socket": a.socket,
        "http.host": a.http_host, "http.port": a.http_port, "cpu.bytes": a.cpu_bytes,
        "nvme.bytes": a.nvme_bytes, "nvme.path": a.nvme_path, "nvme.direct": a.nvme_direct,
        "policy.eviction": a.eviction, "redis.url": a.redis_url,
        "redis.cluster": a.redis_cluster, "redis.password": a.redis_password,
        "redis.codec": a.redis_codec, "redis.ttl_s": a.redis_ttl,
        "redis.write_through": a.redis_write_through,
        "daemon.log_level": a.log_level,
    }
    if a.redis_url:
        o["redis.enabled"] = True
    if a.nvme_bytes is not None and str(a.nvme_bytes).strip() in ("0", "0B"):
        o["nvme.enabled"] = False
    return o


def _run_serve(a: argparse.Namespace) -> int:
    """Run the daemon; a failure to start is one line naming the path and the fix, exit 2
    (StartupError, ConfigError; any other OSError too), the traceback only with --debug."""
    from kvtier.daemon.preflight import setup_error

    try:
        return _serve(a)
    except OSError as exc:   # reading the config file, or anything preflight did not foresee
        raise setup_error(exc) from exc


def _serve(a: argparse.Namespace) -> int:
    from kvtier.config import load_config
    from kvtier.daemon.service import run_daemon

    cfg = load_config(a.config, overrides=_serve_overrides(a))
    logging.basicConfig(
        level=getattr(logging, cfg.daemon.log_level.upper(), logging.INFO), stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    try:
        import uvloop  # type: ignore[import-not-found]

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(run_daemon(cfg))
    return 0


def _add_stats(sub: Any) -> None:
    p = sub.add_parser("stats", help="show per-tier capacity, use, hits and errors")
    p.add_argument("--url", default=None,
                   help="daemon HTTP base URL (default http://127.0.0.1:PORT from config)")
    p.add_argument("--config", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print the /v1/stats JSON")
    p.add_argument("--watch", type=float, metavar="N", help="refresh every N seconds")
    p.set_defaults(func=_run_stats)


def fetch_stats(url: str, timeout: float = 3.0) -> dict[str, Any]:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/stats", timeout=timeout) as resp:
        return json.loads(resp.read())


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_stats(s: dict[str, Any]) -> str:
    """The human table of `kvtier stats`."""
    d = s.get("daemon", {})
    r = s.get("requests", {})
    lines = [f"kvtier {d.get('version', '?')} pid {d.get('pid', '?')}  up "
             f"{d.get('uptime_s', 0):.0f}s  clients {d.get('clients', 0)}  "
             f"prefix hit rate {100 * r.get('prefix_hit_rate', 0):.1f}% "
             f"({r.get('hit_blocks', 0)}/{r.get('lookup_blocks', 0)} blocks)"]
    cols = ("tier", "up", "backend", "capacity", "used", "blocks", "hit blk", "miss",
            "hit tok", "evicted", "alloc fail", "cksum fail", "read", "written", "errors")
    rows = []
    for name, t in s.get("tiers", {}).items():
        rows.append((name, "yes" if t.get("up") else "DOWN", str(t.get("backend", "")),
                     _fmt_bytes(t.get("capacity_bytes", 0)), _fmt_bytes(t.get("used_bytes", 0)),
                     str(t.get("blocks", 0)), str(t.get("hit_blocks", 0)),
                     str(t.get("miss_blocks", 0)), str(t.get("hit_tokens", 0)),
                     str(sum(t.get("evictions", {}).values())),
                     str(t.get("allocation_failures", 0)), str(t.get("checksum_failures", 0)),
                     _fmt_bytes(t.get("bytes_read", 0)), _fmt_bytes(t.get("bytes_written", 0)),
                     str(t.get("errors", 0))))
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    p = s.get("prefetch", {})
    if p:
        lines.append("prefetch: " + "  ".join(f"{k} {v}" for k, v in p.items()))
    bw = s.get("bandwidth", {})
    if bw:
        lines.append("bandwidth: " + "  ".join(f"{k} {_fmt_bytes(v)}/s" for k, v in bw.items()))
    conn = s.get("connector", {})
    if conn.get("engines"):
        lines.append("connector: " + "  ".join(f"{k} {v:g}" for k, v in sorted(conn.items())))
    from kvtier.policy.mrc import render_table  # adaptive policy: mode and live MRC per tier

    mrc = render_table(s)
    if mrc:
        lines.append(mrc)
    return "\n".join(lines)


def _run_stats(a: argparse.Namespace) -> int:
    url = a.url
    if url is None:
        from kvtier.config import load_config

        cfg = load_config(a.config)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
    while True:
        try:
            s = fetch_stats(url)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            print(f"kvtier: no daemon answered at {url} ({reason})", file=sys.stderr)
            return 1
        if a.json:
            print(json.dumps(s, indent=2, sort_keys=True))
        else:
            if a.watch:
                print("\x1b[2J\x1b[H", end="")
            print(render_stats(s))
        if not a.watch:
            return 0
        time.sleep(a.watch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache offload "
                                     "service for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_stats(sub)
    for module, name in _PLUGGABLE:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            p = sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(func=lambda a, exc=exc, name=name: _unavailable(name, exc))
            continue
        mod.add_parser(sub)
    return parser


def _unavailable(name: str, exc: Exception) -> int:
    print(f"kvtier {name}: unavailable in this install ({exc})", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KVTierError as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
