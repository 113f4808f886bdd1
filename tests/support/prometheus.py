"""A real Prometheus server for tests, and an HTTP exporter of a saved vLLM exposition.

``PrometheusServer`` runs Debian's ``prometheus`` binary on loopback with a temp storage
directory and the scrape config the test gives it. ``FixtureExporter`` serves a saved
``/metrics`` text and advances every counter and histogram on each scrape (scaled by
1 + 5% per scrape), so ``rate()`` and ``histogram_quantile()`` over it have data the way
they would over a live engine.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

_GROWING = re.compile(r"^(\S+?(?:_total|_bucket|_sum|_count)(?:\{[^}]*\})?) (\S+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FixtureExporter:
    """Serves ``text`` at /metrics on a free loopback port; counters grow per scrape."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.scrapes = 0
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exporter.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def render(self) -> str:
        self.scrapes += 1
        scale = 1.0 + 0.05 * self.scrapes
        out = []
        for line in self.text.splitlines():
            m = _GROWING.match(line)
            out.append(f"{m.group(1)} {float(m.group(2)) * scale!r}" if m else line)
        return "\n".join(out) + "\n"

    def __enter__(self) -> FixtureExporter:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class PrometheusServer:
    """``prometheus`` on 127.0.0.1 scraping ``targets`` (job name -> host:port)."""

    root: Path
    targets: dict[str, str]
    scrape_interval: str = "1s"
    rule_files: list[Path] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus not found: `make test` installs it "
                               "(apt-get install prometheus)")
        self.root.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": self.scrape_interval,
                       "evaluation_interval": self.scrape_interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                               for job, t in self.targets.items()],
        }
        cfg = self.root / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.port = free_port()
        log = open(self.root / "prometheus.log", "wb")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not start:\n{self.log()}")

    def log(self) -> str:
        path = self.root / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise RuntimeError(f"prometheus: {doc}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (empty: no data)."""
        return list(self.api("query", query=expr)["result"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
