"""Every panel of deploy/grafana/kvtier.json returns data from a real Prometheus.

A real daemon runs under a short load (puts that overflow the cpu tier into nvme and nvme
into nothing, lookups that promote, gets, a connector's engine report); a saved vLLM
exposition is served over HTTP with counters that grow per scrape. Prometheus scrapes both
every second, loads alerts.yml, and then every panel query (Grafana's variables filled in)
must return a non-empty vector; every metric an alert names must exist; every rule must
evaluate without error.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from kvtier.client import connect
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from tests.support.daemon import DaemonProcess
from tests.support.prometheus import FixtureExporter, PrometheusServer
from tests.support.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ENGINE = ROOT / "tests" / "fixtures" / "doctor" / "preemption" / "engine-0.prom"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16",
                  tokens_per_block=64)   # 32 KiB blocks
VARIABLES = {"$instance": ".*", "$engine": ".*", "$__rate_interval": "10s"}

pytestmark = pytest.mark.timeout(120)


def panel_queries() -> list[tuple[str, str, str]]:
    """(row, panel, expr) for every target, variables filled in as Grafana would."""
    out, row = [], ""
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        if p["type"] == "row":
            row = p["title"]
            continue
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            out.append((row, p["title"], expr))
    return out


def load(sock: Path, stop: threading.Event) -> None:
    """Offload traffic until ``stop``: new prompts evict old ones, old ones come back."""
    c = connect(sock)
    ns = c.register_layout(LAYOUT, "ops/test-model")
    c.report_engine(running=3, waiting=1, preemptions=2, context_tokens_p50=900,
                    context_tokens_p99=7000)
    buf = np.full(LAYOUT.block_bytes, 7, np.uint8)
    out = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(8)]
    chains: list[list[bytes]] = []
    i = 0
    while not stop.is_set():
        keys = block_keys(ns, np.arange(i * 10_000, i * 10_000 + 8 * 64))
        c.put(ns, keys, [buf] * len(keys))
        chains.append(keys)
        for old in (chains[i // 2], chains[max(i - 20, 0)], keys):
            c.lookup(ns, old)
            c.get(ns, old, out[: len(old)])
        c.lookup(ns, block_keys(ns, np.arange(10**8, 10**8 + 128)))  # never stored
        i += 1
        time.sleep(0.01)
    c.close()


def wait_for_data(prom: PrometheusServer, queries: list[tuple[str, str, str]],
                  timeout: float = 40.0) -> dict[str, list[dict[str, Any]]]:
    deadline = time.monotonic() + timeout
    results: dict[str, list[dict[str, Any]]] = {}
    while True:
        results = {q: prom.query(q) for _, _, q in queries}
        if all(results.values()) or time.monotonic() > deadline:
            return results
        time.sleep(1.0)


def test_every_panel_query_returns_data(tmp_path: Path, redis_server: RedisServer) -> None:
    # every tier, Redis too: some series exist only for the tiers that count them
    daemon = DaemonProcess(tmp_path / "kvd", cpu_bytes="2MiB", nvme_bytes="4MiB",
                           extra_args=["--redis-url", redis_server.url],
                           env={"KVTIER_CPU_SLAB_BYTES": "1MiB",
                                "KVTIER_NVME_WRITE_BUDGET_BYTES_PER_S": "1GB"}).start()
    stop = threading.Event()
    worker = threading.Thread(target=load, args=(daemon.socket, stop), daemon=True)
    prom = None
    try:
        with FixtureExporter(ENGINE.read_text()) as engine:
            worker.start()
            prom = PrometheusServer(
                tmp_path / "prom",
                {"kvtier": daemon.http_url.removeprefix("http://"),
                 "vllm": f"127.0.0.1:{engine.port}"},
                rule_files=[ALERTS]).start()
            queries = panel_queries()
            results = wait_for_data(prom, queries)
            empty = [f"{row} / {panel}: {q}" for row, panel, q in queries if not results[q]]
            assert not empty, "panels without data:\n" + "\n".join(empty) + "\n" + prom.log()
            # the load really moved blocks through every path the tier row shows
            moved = {(r["metric"]["src"], r["metric"]["dst"])
                     for r in prom.query("kvtier_bytes_moved_total > 0")}
            assert {("cpu", "nvme"), ("nvme", "cpu")} <= moved
            hit = prom.query("kvtier_prefix_hit_rate")
            assert 0 < float(hit[0]["value"][1]) < 1

            names = set(prom.api("label/__name__/values"))
            rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"]
                     for r in g["rules"]]
            for rule in rules:
                for name in re.findall(r"\b(kvtier_[a-z0-9_]+|vllm:[a-z0-9_:]+)", rule["expr"]):
                    assert name in names, f"alert {rule['alert']} names {name}: no such series"
            groups = prom.api("rules")["groups"]
            loaded = [r for g in groups for r in g["rules"]]
            assert len(loaded) == len(rules)
            assert all(r["health"] != "err" for r in loaded), \
                [(r["name"], r.get("lastError")) for r in loaded if r["health"] == "err"]
            print_live_results(queries, results)
    finally:
        stop.set()
        worker.join(10)
        if prom is not None:
            prom.stop()
        daemon.terminate()


def print_live_results(queries: list[tuple[str, str, str]],
                       results: dict[str, list[dict[str, Any]]]) -> None:
    """For the record (pytest -s): per row, each panel's first live series and value."""
    row_seen, panel_seen = "", set()
    for row, panel, q in queries:
        if row != row_seen:
            print(f"\n[{row}]")
            row_seen = row
        if panel in panel_seen:
            continue
        panel_seen.add(panel)
        sample = results[q][0]
        labels = {k: v for k, v in sample["metric"].items() if k not in ("instance", "job")}
        print(f"  {panel}: {q[:70]}{'...' if len(q) > 70 else ''} -> {labels} "
              f"{float(sample['value'][1]):.4g} ({len(results[q])} series)")
