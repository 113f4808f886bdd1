"""`kvtier serve | stats | plan | doctor | replay | explain`.

Subcommands owned by other modules register themselves through an ``add_parser``
function; a subcommand whose optional dependencies are missing is still listed and says
what to install.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from kvtier import __version__, httpget, jsonin
from kvtier.argtypes import OneLineParser, float_in, http_url
from kvtier.errors import KVTierError
from kvtier.statsdoc import MalformedStats, check_policy, clean, number, scalar, section
from kvtier.units import format_bytes

if TYPE_CHECKING:
    from kvtier.daemon.parts import DaemonParts

MAX_WATCH_S = 86_400.0
"""Longest ``kvtier stats --watch`` refresh interval: a day."""

_PLUGGABLE = (
    ("kvtier.plan.cli", "plan"),
    ("kvtier.doctor.cli", "doctor"),
    ("kvtier.replay.cli", "replay"),
    ("kvtier.explain_cli", "explain"),
)


# Today's short flag names, kept as aliases of the generated ``--section-field`` ones.
SERVE_ALIASES: dict[str, tuple[str, ...]] = {
    "daemon.data_dir": ("--data-dir",), "daemon.socket": ("--socket",),
    "daemon.log_level": ("--log-level",), "policy.eviction": ("--eviction",),
    "redis.ttl_s": ("--redis-ttl",),
}


def _flag(dotted: str) -> str:
    return "--" + dotted.replace(".", "-").replace("_", "-")


def _add_serve(sub: Any) -> None:
    """``kvtier serve``: one flag per field of the config tree (``--section-field``)."""
    from enum import Enum

    from kvtier.config import Config
    from kvtier.config_convert import iter_settings
    from kvtier.units import ByteSize

    p = sub.add_parser("serve", help="run the node daemon in the foreground",
                       description="Run the kvtier daemon. Settings: TOML file < env "
                       "KVTIER_<SECTION>_<FIELD> < these flags (one per setting).")
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of a startup failure (default: one line)")
    for s in iter_settings(Config):
        names = [_flag(s.dotted), *SERVE_ALIASES.get(s.dotted, ())]
        env = f"KVTIER_{s.section.upper()}_{s.name.upper()}"
        kw: dict[str, Any] = {"dest": "cfg__" + s.dotted, "default": None}
        if s.base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(s.base, type) and issubclass(s.base, Enum):
            kw["choices"] = [str(m.value) for m in s.base]
            kw["type"] = str.lower
        else:
            kw["metavar"] = ("SIZE" if s.base is ByteSize else
                             getattr(s.base, "__name__", "VALUE").upper())
        size = " (e.g. 4GiB, 512MiB)" if s.base is ByteSize else ""
        p.add_argument(*names, help=f"{s.dotted}{size}; env {env}", **kw)
    p.set_defaults(func=_run_serve)


def _serve_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """``section.field`` -> flag value (None: not given). What they imply (--redis-url
    enables the redis tier, --nvme-bytes 0 disables nvme) is ``kvtier.config.implied``,
    the same for the TOML file and the environment."""
    return {k[len("cfg__"):]: v for k, v in vars(a).items() if k.startswith("cfg__")}


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
    from kvtier.config_checks import check_redis_files
    from kvtier.daemon.service import run_daemon

    cfg = load_config(a.config, overrides=_serve_overrides(a))
    check_redis_files(cfg)
    logging.basicConfig(
        level=getattr(logging, cfg.daemon.log_level.upper(), logging.INFO), stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(run_daemon(cfg, parts=getattr(a, "daemon_parts", None)))
    return 0


def _add_stats(sub: Any) -> None:
    p = sub.add_parser("stats", help="show per-tier capacity, use, hits and errors")
    p.add_argument("--url", default=None, type=http_url,
                   help="daemon HTTP base URL (default http://127.0.0.1:PORT from config)")
    p.add_argument("--config", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print the /v1/stats JSON")
    p.add_argument("--watch", type=float_in(0, MAX_WATCH_S, above=True), metavar="N",
                   help=f"refresh every N seconds (at most {MAX_WATCH_S:g}); a failed "
                   "scrape is one line with the time, and the watch goes on")
    p.set_defaults(func=_run_stats)


STATS_DEADLINE_S = httpget.DEFAULT_DEADLINE_S
"""Seconds one ``/v1/stats`` fetch may take in all (a slow or stuck peer ends in one line)."""


def fetch_stats(url: str, timeout: float = STATS_DEADLINE_S) -> dict[str, Any]:
    """The daemon's ``/v1/stats``, fetched within ``timeout`` seconds in all and at most
    httpget.MAX_BODY_BYTES; httpget.FetchError when no usable reply came, ValueError when
    the reply is not a JSON object."""
    doc = jsonin.loads(httpget.get(url.rstrip("/") + "/v1/stats", deadline_s=timeout))
    if not isinstance(doc, dict):
        raise ValueError(f"the answer is a JSON {type(doc).__name__}, not an object")
    return doc


def render_stats(s: dict[str, Any]) -> str:
    """The human table of `kvtier stats`; MalformedStats (naming the field) when a field
    has a type it cannot show: the whole answer is refused rather than half drawn."""
    d = section(s, "daemon")
    r = section(s, "requests")
    lag = ""
    if "loop" in d:
        worst = number(section(d, "loop", "daemon."), "lag_worst_s", "daemon.loop.")
        lag = f"  event loop worst lag {1e3 * worst:.0f} ms"
    lines = [f"kvtier {scalar(d, 'version', '?', 'daemon.')} pid "
             f"{scalar(d, 'pid', '?', 'daemon.')}  up {number(d, 'uptime_s', 'daemon.'):.0f}s"
             f"  clients {scalar(d, 'clients', '0', 'daemon.')}  prefix hit rate "
             f"{100 * number(r, 'prefix_hit_rate', 'requests.'):.1f}% "
             f"({scalar(r, 'hit_blocks', '0', 'requests.')}/"
             f"{scalar(r, 'lookup_blocks', '0', 'requests.')} blocks)" + lag]
    cols = ("tier", "up", "backend", "capacity", "used", "blocks", "hit blk", "miss",
            "hit tok", "evicted", "alloc fail", "cksum fail", "read", "written", "errors")
    rows = []
    for name, t in section(s, "tiers").items():
        w = f"tiers.{clean(name)}."
        if not isinstance(t, dict):
            raise MalformedStats(f"tiers.{clean(name)} is not an object")
        evictions = section(t, "evictions", w)
        evicted = sum(number(evictions, k, w + "evictions.") for k in evictions)
        rows.append((clean(name), "yes" if t.get("up") else "DOWN",
                     scalar(t, "backend", "", w),
                     _capacity(t, w), format_bytes(number(t, "used_bytes", w)),
                     scalar(t, "blocks", "0", w), scalar(t, "hit_blocks", "0", w),
                     scalar(t, "miss_blocks", "0", w), scalar(t, "hit_tokens", "0", w),
                     f"{evicted:.0f}",
                     scalar(t, "allocation_failures", "0", w),
                     scalar(t, "checksum_failures", "0", w),
                     format_bytes(number(t, "bytes_read", w)),
                     format_bytes(number(t, "bytes_written", w)),
                     scalar(t, "errors", "0", w)))
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    p = section(s, "prefetch")
    if p:
        lines.append("prefetch: " + "  ".join(f"{clean(k)} "
                                              f"{scalar(p, k, '', 'prefetch.')}" for k in p))
    bw = section(s, "bandwidth")
    if bw:
        lines.append("bandwidth: " + "  ".join(
            f"{clean(k)} {format_bytes(number(bw, k, 'bandwidth.'))}/s"
            for k in bw))
    conn = section(s, "connector")
    if conn.get("engines"):
        lines.append("connector: " + "  ".join(
            f"{clean(k)} {number(conn, k, 'connector.', negative_ok=True):g}"
            for k in sorted(conn)))
    from kvtier.policy.mrc import render_table  # adaptive policy: mode and live MRC per tier

    check_policy(s)
    mrc = render_table(s)
    if mrc:
        lines.append(mrc)
    return "\n".join(lines)


def _capacity(t: dict[str, Any], where: str) -> str:
    """A tier's capacity cell: ``no limit`` when the daemon reports none (a null
    ``capacity_bytes``: Redis without ``redis.bytes`` or a ``maxmemory``), and where it is
    the Redis server's ``maxmemory``, said so."""
    if "capacity_bytes" in t and t["capacity_bytes"] is None:
        return "no limit"
    cap = format_bytes(number(t, "capacity_bytes", where))
    return f"{cap} maxmemory" if t.get("capacity_from") == "maxmemory" else cap


def _run_stats(a: argparse.Namespace) -> int:
    """Print the daemon's stats (once, or every ``--watch`` seconds). Once: exit status 1,
    with one line, when no daemon answered or its answer is not kvtier stats (cut short,
    too slow, too large, not JSON, or a field of the wrong type). Watching: that line with
    the time, and the next refresh as usual, so a daemon restart does not end the watch
    (it did, found by review); Ctrl-C ends it."""
    from kvtier.config import daemon_url

    url = daemon_url(a.url, a.config)
    while True:
        try:
            s = fetch_stats(url, timeout=STATS_DEADLINE_S)
            shown = json.dumps(s, indent=2, sort_keys=True) if a.json else render_stats(s)
        except httpget.Unreachable as exc:
            failed = f"no daemon answered at {url} ({exc})"
        except (httpget.FetchError, ValueError) as exc:
            failed = (f"the answer from {url}/v1/stats is not kvtier stats ({exc}); is --url "
                      "the daemon's HTTP port?")
        else:
            failed = ""
        if failed and not a.watch:
            print(f"kvtier: {failed}", file=sys.stderr)
            return 1
        if failed:
            print(f"kvtier: {time.strftime('%H:%M:%S')} {failed}; next try in {a.watch:g}s",
                  file=sys.stderr, flush=True)
        else:
            if a.watch and not a.json:
                print("\x1b[2J\x1b[H", end="")
            print(shown, flush=bool(a.watch))
        if not a.watch:
            return 0
        time.sleep(a.watch)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``command``: ``serve``, ``plan``...) only what that
    command needs: the other commands' modules are not imported, so ``kvtier serve``
    starts about 0.1 s sooner (and every CLI call but help and typos)."""
    parser = OneLineParser(prog="kvtier",
                           description="Tiered KV-cache offload service for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_stats(sub)
    known = {name for _, name in _PLUGGABLE} | {"serve", "stats"}
    for module, name in _PLUGGABLE:
        if command in known and command != name:
            continue
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


def main(argv: list[str] | None = None, *, parts: DaemonParts | None = None) -> int:
    """The ``kvtier`` command; ``parts`` (for ``serve``) builds the daemon's tiers another
    way (kvtier.daemon.parts; the CPU tests' fake HBM pool comes in through it)."""
    given = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((a for a in given if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    args.daemon_parts = parts
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # the reader went away (`kvtier plan --json | head`): no traceback; stdout goes to
        # /dev/null so the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    except KVTierError as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
