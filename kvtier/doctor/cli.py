"""``kvtier doctor``: argument parsing and the command's entry point.

Exit status: 0 healthy, 1 one or more findings, 2 the metrics could not be read. With
``--env`` it checks the node instead (kvtier.doctor.env): 0 nothing failed, 1 a check
failed, 2 the configuration could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from kvtier.argtypes import float_in, http_url, int_in
from kvtier.doctor.collect import DEFAULT_STATS_URL, Request, collect, stats_url
from kvtier.doctor.errors import DoctorError
from kvtier.doctor.report import render_text, to_json
from kvtier.doctor.rules import diagnose
from kvtier.doctor.signals import derive
from kvtier.doctor.sources import is_url

EXIT_HEALTHY = 0
EXIT_FINDINGS = 1
EXIT_UNREADABLE = 2

MAX_SAMPLES = 10_000
"""Most live scrapes one run takes (each is kept until the diagnosis)."""
MAX_INTERVAL_S = 86_400.0
"""Longest wait between two scrapes: a day."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``doctor`` on the ``kvtier`` command line."""
    p = subparsers.add_parser(
        "doctor", help="match live or saved metrics against common KV failure patterns",
        description="Reads kvtier's /v1/stats and, optionally, the serving engine's "
                    "Prometheus metrics (vLLM names), and reports which KV failure patterns "
                    "they show, with evidence and what to change. Exit status: 0 healthy, "
                    "1 findings, 2 metrics unreadable.")
    p.add_argument("--stats", nargs="+", metavar="URL|FILE", default=None,
                   help="kvtier /v1/stats URL, or saved JSON files oldest first (default: "
                        f"the /v1/stats of --url, {DEFAULT_STATS_URL} unless the config "
                        "or KVTIER_HTTP_HOST/KVTIER_HTTP_PORT say otherwise)")
    p.add_argument("--url", default=None, type=http_url,
                   help="daemon HTTP base URL (default http://HOST:PORT from the config)")
    p.add_argument("--config", metavar="FILE",
                   help="the daemon's TOML config: its HTTP address, and what --env checks")
    p.add_argument("--engine-metrics", nargs="+", metavar="URL|FILE", default=None,
                   help="engine Prometheus endpoint (e.g. http://127.0.0.1:8000/metrics), or "
                        "saved scrapes oldest first")
    p.add_argument("--gpu-metrics", nargs="+", metavar="URL|FILE", default=None,
                   help="DCGM exporter endpoint or saved scrapes (GPU and memory busy)")
    p.add_argument("--samples", type=int_in(1, MAX_SAMPLES), default=2,
                   help="scrapes of live endpoints (2 or more for rates and trends; at most "
                        f"{MAX_SAMPLES:,})")
    p.add_argument("--interval", type=float_in(0, MAX_INTERVAL_S, above=True), default=None,
                   help="seconds between scrapes, or between the saved files "
                        "(default 5, or the daemon's uptime difference for saved stats; at "
                        f"most {MAX_INTERVAL_S:g})")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    env = p.add_argument_group("node checks (--env)")
    env.add_argument("--env", action="store_true",
                     help="check this node instead: /dev/shm, data dir, memlock, huge pages, "
                          "NUMA, GPU/GDS, socket dir, clients' key scheme, the Redis server")
    env.add_argument("--no-daemon", action="store_true",
                     help="do not ask the daemon (--env; e.g. before it starts)")
    env.add_argument("--strict", action="store_true",
                     help="warnings count as failures in the exit status (--env)")
    p.set_defaults(func=run)


def _sleeper(show: bool) -> Callable[[float], None]:
    """time.sleep between live samples, with a progress bar on a terminal's stderr."""
    if not show:
        return time.sleep

    def sleep(seconds: float) -> None:
        from kvtier import ui

        ticks = max(int(seconds * 10), 1)
        with ui.progress(ticks, "next sample", enabled=True) as advance:
            for _ in range(ticks):
                time.sleep(seconds / ticks)
                advance(1)

    return sleep


def _unreadable(args: argparse.Namespace, what: str, exc: Exception) -> int:
    """Say why nothing could be diagnosed (stderr, or JSON on stdout); exit status 2."""
    if args.json:
        print(json.dumps({"status": "unreadable", "error": str(exc)}, indent=2))
    else:
        print(f"kvtier doctor: could not read {what}: {exc}", file=sys.stderr)
    return EXIT_UNREADABLE


def run_env(args: argparse.Namespace) -> int:
    """``kvtier doctor --env``: verdicts and fixes for this node."""
    from kvtier.config import daemon_url, load_config
    from kvtier.doctor.env import exit_status, render, run_checks
    from kvtier.doctor.env import to_json as env_json
    from kvtier.errors import KVTierError

    try:
        cfg = load_config(args.config)
    except (KVTierError, OSError) as exc:
        return _unreadable(args, "the configuration", exc)
    url = None if args.no_daemon else daemon_url(args.url, cfg)
    checks = run_checks(cfg, daemon_url=url)
    status = exit_status(checks, strict=args.strict)
    if args.json:
        print(json.dumps(env_json(checks, status), indent=2))
    else:
        render(checks)
    return status


FROM_CONFIG = ("its address comes from the config's http.host and http.port (--config FILE, "
               "KVTIER_HTTP_HOST, KVTIER_HTTP_PORT; 127.0.0.1:8470 by default): give the "
               "daemon's with --url http://HOST:PORT")


def stats_source(args: argparse.Namespace) -> tuple[tuple[str, ...], bool, str]:
    """Where the kvtier stats come from, as ``kvtier stats`` finds the daemon
    (kvtier.config.daemon_url): ``--stats``, else the /v1/stats of ``--url``, else of the
    configuration's HTTP address. Returns (the references, whether they were asked for,
    what set them); DoctorError for --stats with --url, KVTierError for a configuration
    that cannot be read."""
    if args.stats:
        if args.url:
            raise DoctorError("give --stats URL|FILE or --url URL, not both")
        return tuple(args.stats), True, "its URL was given with --stats"
    if args.url:
        return (stats_url(args.url),), True, "its address was given with --url"
    engine = args.engine_metrics or ()
    if engine and not is_url(engine[0]):
        return (), False, ""   # saved engine files: a live daemon's stats would not match
    from kvtier.config import daemon_url

    return (stats_url(daemon_url(None, args.config)),), False, FROM_CONFIG


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvtier doctor``; returns the exit status."""
    if getattr(args, "env", False):
        return run_env(args)
    from kvtier.errors import KVTierError

    try:
        stats, explicit, named_by = stats_source(args)
    except DoctorError as exc:
        return _unreadable(args, "metrics", exc)
    except (KVTierError, OSError) as exc:
        return _unreadable(args, "the configuration", exc)
    try:
        req = Request(stats=stats, stats_explicit=explicit, stats_from=named_by,
                      engine=tuple(args.engine_metrics or ()),
                      gpu=tuple(args.gpu_metrics or ()),
                      samples=args.samples, interval_s=args.interval)
        got = collect(req, sleep=_sleeper(show=not args.json and sys.stderr.isatty()))
        if not got.engine and not got.stats:
            raise DoctorError("no metrics to read: give --stats and/or --engine-metrics")
    except DoctorError as exc:
        return _unreadable(args, "metrics", exc)
    signals = derive(got.engine, got.stats, got.interval_s)
    if got.stats:  # tier sizing from the adaptive policy's live miss-ratio curve
        from kvtier.policy.mrc import sizing_notes
        from kvtier.statsdoc import MalformedStats

        last = got.stats[-1]
        try:
            got.notes.extend(sizing_notes({"policy": last.policy,
                                           "tiers": {n: {"capacity_bytes": t.capacity_bytes}
                                                     for n, t in last.tiers.items()}}))
        except MalformedStats as exc:  # a curve point of scale 0 (found by review)
            got.notes.append(f"tier sizing skipped: {last.source} has a malformed live "
                             f"miss-ratio curve ({exc})")
    findings = diagnose(signals)
    if args.json:
        print(json.dumps(to_json(findings, signals, got), indent=2))
    else:
        print(render_text(findings, signals, got))
    return EXIT_FINDINGS if findings else EXIT_HEALTHY


def main(argv: list[str] | None = None) -> int:
    """Run ``doctor`` alone (``python -m kvtier.doctor``) until kvtier's CLI wires it in."""
    parser = argparse.ArgumentParser(prog="kvtier")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
