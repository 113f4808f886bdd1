"""Doctor's inputs: histograms, live endpoints, and metrics it cannot read."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.doctor import add_parser
from kvtier.doctor.engine import parse_engine
from kvtier.doctor.histogram import Histogram
from tests.support.cli import run_subcommand

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"


def doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_subcommand(capsys, add_parser, "doctor", *argv)


def test_histogram_quantile_interpolates_like_promql() -> None:
    inf = float("inf")
    h = Histogram((1.0, 2.0, 4.0, inf), (10.0, 30.0, 40.0, 40.0), total=70.0, count=40.0)
    assert h.mean() == pytest.approx(1.75)
    assert h.quantile(0.5) == pytest.approx(1.5)  # rank 20: halfway through (1, 2]
    assert h.quantile(0.25) == pytest.approx(1.0)
    assert h.quantile(0.9) == pytest.approx(3.2)  # rank 36: 6 of 10 into (2, 4]
    older = Histogram((1.0, 2.0, 4.0, inf), (10.0, 10.0, 10.0, 10.0), total=5.0, count=10.0)
    recent = h.minus(older)
    assert recent.counts == (0.0, 20.0, 30.0, 30.0) and recent.count == 30.0
    assert Histogram((1.0, inf), (0.0, 0.0), 0.0, 0.0).quantile(0.5) is None


def test_vllm_scrape_is_parsed_with_fallback_names() -> None:
    old_names = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        "# TYPE vllm:time_per_output_token_seconds histogram\n"
        'vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 3\n'
        'vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4\n'
        'vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2\n'
        'vllm:time_per_output_token_seconds_count{model_name="m"} 4\n'
    )
    s = parse_engine(old_names, "old.prom")
    from kvtier.doctor import engine as m
    assert s.get(m.KV_USAGE) == 0.5
    itl = s.histogram(m.ITL)
    assert itl is not None and itl.mean() == pytest.approx(0.05)


def test_two_engines_are_summed_and_usage_takes_the_max() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 5\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.4\nvllm:kv_cache_usage_perc{engine="1"} 0.9\n'
    )
    s = parse_engine(text, "dp.prom")
    assert s.values["vllm:num_requests_running"] == 8
    assert s.values["vllm:kv_cache_usage_perc"] == 0.9


def test_cache_config_info_gives_the_pool_size() -> None:
    text = (FIXTURES / "undersized_p99" / "engine-1.prom").read_text()
    assert parse_engine(text, "x").kv_capacity_tokens == 40_000 * 16


class _Server:
    """A real HTTP server handing out a sequence of documents per path."""

    def __init__(self, docs: dict[str, list[bytes]]) -> None:
        self.docs = {k: list(v) for k, v in docs.items()}
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                queue = owner.docs.get(self.path)
                if not queue:
                    self.send_error(404)
                    return
                body = queue.pop(0) if len(queue) > 1 else queue[0]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def server() -> Iterator[_Server]:
    d = FIXTURES / "preemption"
    srv = _Server({
        "/metrics": [(d / f"engine-{i}.prom").read_bytes() for i in range(2)],
        "/v1/stats": [(d / f"stats-{i}.json").read_bytes() for i in range(2)],
    })
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def test_live_endpoints_are_sampled_twice(capsys: pytest.CaptureFixture[str],
                                          server: _Server) -> None:
    code, out, err = doctor(capsys, "--engine-metrics", f"{server.url}/metrics", "--stats",
                            f"{server.url}/v1/stats", "--samples", "2", "--interval", "0.05",
                            "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert [f["pattern"] for f in doc["findings"]] == ["preemption"]
    assert doc["signals"]["samples"] == 2


def test_http_error_is_exit_2(capsys: pytest.CaptureFixture[str], server: _Server) -> None:
    code, out, err = doctor(capsys, "--stats", f"{server.url}/nope", "--samples", "1")
    assert code == 2 and out == ""
    assert "HTTP 404" in err and "Traceback" not in err


def test_nothing_listening_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = doctor(capsys, "--stats", "http://127.0.0.1:9/v1/stats", "--samples", "1")
    assert code == 2
    assert err.startswith("kvtier doctor: could not read metrics:")
    code, out, _ = doctor(capsys, "--stats", "http://127.0.0.1:9/v1/stats", "--samples", "1",
                          "--json")
    assert code == 2 and json.loads(out)["status"] == "unreadable"


def test_default_stats_url_is_not_mixed_with_saved_files(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = doctor(capsys, "--engine-metrics",
                          *sorted(str(p) for p in (FIXTURES / "healthy").glob("engine-*")),
                          "--json")
    assert code == 0
    assert json.loads(out)["sources"]["stats"] == []


@pytest.mark.parametrize(("content", "flag", "needle"), [
    (None, "--stats", "cannot read kvtier stats file"),
    ("{not json", "--stats", "is not kvtier stats JSON"),
    ('["a list"]', "--stats", "expected a JSON object"),
    ('{"unrelated": 1}', "--stats", "none of kvtier's stats sections"),
    ("\x00\x01garbage {{{", "--engine-metrics", "not Prometheus exposition"),
    ("# TYPE node_load1 gauge\nnode_load1 0.5\n", "--engine-metrics", "no vLLM metrics"),
])
def test_unreadable_metrics_are_exit_2_with_a_message(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | None, flag: str,
        needle: str) -> None:
    path = tmp_path / "snapshot"
    if content is not None:
        path.write_text(content)
    code, out, err = doctor(capsys, flag, str(path))
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err


def test_truncated_scrape_is_exit_2_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    text = (FIXTURES / "healthy" / "engine-1.prom").read_text()
    cut = tmp_path / "cut.prom"
    cut.write_text(text[: text.index("vllm:request_prompt_tokens_bucket") + 40])
    code, out, err = doctor(capsys, "--engine-metrics", str(cut))
    assert code == 2 and out == ""
    assert "is not Prometheus exposition text" in err and "Traceback" not in err


def test_partial_stats_are_read_with_a_note(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    full = json.loads((FIXTURES / "fragmentation" / "stats-1.json").read_text())
    before = json.loads((FIXTURES / "fragmentation" / "stats-0.json").read_text())
    paths = []
    for i, doc in enumerate((before, full)):
        partial = {"version": 1, "tiers": {"cpu": {k: v for k, v in doc["tiers"]["cpu"].items()
                                                   if k != "evictions"}}}
        p = tmp_path / f"s{i}.json"
        p.write_text(json.dumps(partial))
        paths.append(str(p))
    code, out, err = doctor(capsys, "--stats", *paths)
    assert code == 1, err
    assert "(fragmentation)" in out
    flat = " ".join(out.split())
    assert "kvtier stats lack 'daemon', 'requests', 'connector'" in flat


def test_missing_keys_everywhere_do_not_crash(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"daemon": {}, "tiers": {"cpu": {"name": "cpu"}, "x": 3},
                             "requests": {"lookup_tokens": "many"}, "connector": None}))
    code, out, err = doctor(capsys, "--stats", str(p))
    assert code == 0 and "Traceback" not in err
    assert out.startswith("kvtier doctor: healthy")


def test_several_urls_for_one_source_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = doctor(capsys, "--stats", "http://a/v1/stats", "http://b/v1/stats")
    assert code == 2 and "one URL" in err


@pytest.mark.parametrize(("body", "needle"), [
    ("[" * 100_000, "nested too deeply"),
    ('{"daemon": ' * 50_000 + "{}" + "}" * 50_000, "nested too deeply"),
    ('{"version": ' + "9" * 5000 + ', "daemon": {}}', "too long"),
])
def test_hostile_stats_json_is_one_line_exit_2(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path, body: str, needle: str) -> None:
    p = tmp_path / "s.json"
    p.write_text(body)
    code, out, err = doctor(capsys, "--stats", str(p))
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and str(p) in err and needle in err


def test_a_scrape_cut_mid_line_says_why_it_cannot_be_read(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """prometheus_client raises a ValueError with no message on a cut-off TYPE line."""
    cut = tmp_path / "trunc.prom"
    cut.write_text("# TYPE vllm:num_requests_running gauge\n"
                   'vllm:num_requests_running{engine="0"} 40.0\n'
                   "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
                   "# TYPE vllm:num")
    code, out, err = doctor(capsys, "--stats", str(FIXTURES / "healthy" / "stats-0.json"),
                            "--engine-metrics", str(cut))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    reason = err.split("is not Prometheus exposition text:", 1)[1].strip()
    assert reason.startswith("a line is cut off or malformed (ValueError)")
    assert "ends mid-line" in reason


@pytest.mark.parametrize(("line", "shown"), [
    ('vllm:num_requests_running{model_name="m"} NaN', "vllm:num_requests_running is nan"),
    ('vllm:num_requests_waiting{model_name="m"} +Inf', "vllm:num_requests_waiting is inf"),
    ('vllm:kv_cache_usage_perc{model_name="m"} -1', "vllm:kv_cache_usage_perc is -1"),
    ('vllm:num_preemptions_total{model_name="m"} -3', "vllm:num_preemptions_total is -3"),
    ('vllm:time_to_first_token_seconds_bucket{le="+Inf"} NaN',
     "vllm:time_to_first_token_seconds_bucket is nan"),
])
def test_non_finite_or_negative_values_are_unreadable_not_healthy(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str, shown: str) -> None:
    prom = tmp_path / "nanval.prom"
    prom.write_text('vllm:num_requests_running{model_name="m"} 4\n'
                    "# TYPE vllm:time_to_first_token_seconds histogram\n" + line + "\n")
    code, out, err = doctor(capsys, "--engine-metrics", str(prom))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("kvtier doctor: could not read metrics:")
    assert f"{prom}: {shown}, not a finite number >= 0" in err
    code, out, _ = doctor(capsys, "--engine-metrics", str(prom), "--json")
    assert code == 2 and json.loads(out)["status"] == "unreadable"


def test_unread_metrics_may_be_nan() -> None:
    """Only what doctor reads is checked: an unrelated gauge's NaN is not its business."""
    s = parse_engine('process_cpu_seconds_total NaN\nvllm:num_requests_running 2\n', "x")
    assert s.get(("vllm:num_requests_running",)) == 2.0


@pytest.mark.parametrize("where", [("tiers", "cpu", "used_bytes"), ("daemon", "uptime_s"),
                                   ("requests", "hit_tokens")])
def test_a_number_too_large_for_a_float_is_exit_2(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, where: tuple[str, ...]) -> None:
    """10**400 in saved or live /v1/stats: float() raised OverflowError (a traceback, exit
    1); now the documented exit 2 naming the field, as kvtier stats says it."""
    doc: dict = {"version": 1, "daemon": {"uptime_s": 5}, "requests": {},
                 "tiers": {"cpu": {"capacity_bytes": 100, "used_bytes": 5}}, "connector": {}}
    node = doc
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = 10**400
    p = tmp_path / "s.json"
    p.write_text(json.dumps(doc))
    code, out, err = doctor(capsys, "--stats", str(p))
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert f"{'.'.join(where)} is a number too large to show" in err


def _kvtier_metrics_page() -> str:
    """kvtier's own /metrics, rendered by the daemon's registry: histograms, no vllm: name."""
    from prometheus_client import generate_latest

    from kvtier.daemon.metrics import Metrics

    metrics = Metrics(lambda: {})
    metrics.observe("lookup", 0.002)
    return generate_latest(metrics.registry).decode()


FOREIGN_HISTOGRAM = ("# TYPE foo_seconds histogram\n"
                     'foo_seconds_bucket{le="0.1"} 3\nfoo_seconds_bucket{le="+Inf"} 4\n'
                     "foo_seconds_sum 0.5\nfoo_seconds_count 4\n")


@pytest.mark.parametrize("page", [_kvtier_metrics_page(), FOREIGN_HISTOGRAM],
                         ids=["kvtier-metrics", "foo-seconds"])
def test_a_page_of_other_histograms_is_not_the_engines_metrics(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, page: str) -> None:
    """Any histogram used to count as vLLM's: such a page was 'healthy', exit 0."""
    prom = tmp_path / "other.prom"
    prom.write_text(page)
    assert parse_engine(page, str(prom)).histograms  # the page does hold histograms
    code, out, err = doctor(capsys, "--engine-metrics", str(prom))
    assert (code, out) == (2, "")
    assert f"no vLLM metrics in {prom}" in err and len(err.strip().splitlines()) == 1


def test_a_vllm_page_is_still_the_engines_metrics(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    """A real vLLM scrape, and one holding only a vllm: histogram, are read."""
    code, out, _ = doctor(capsys, "--engine-metrics",
                          str(FIXTURES / "healthy" / "engine-0.prom"))
    assert code == 0 and out.startswith("kvtier doctor: healthy")
    prom = tmp_path / "ttft-only.prom"
    prom.write_text(FOREIGN_HISTOGRAM.replace("foo_seconds", "vllm:time_to_first_token_seconds"))
    assert parse_engine(prom.read_text(), str(prom)).has_engine_metrics
    code, _, err = doctor(capsys, "--engine-metrics", str(prom))
    assert code == 0, err
