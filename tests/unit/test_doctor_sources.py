"""Which sources doctor fetches over HTTP and which it reads as files (the doctor review's
SO1 gap: an https source read as a file name went unnoticed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier import httpget
from kvtier.doctor import sources
from kvtier.doctor.errors import DoctorError


@pytest.mark.parametrize("ref", ["http://h:8000/metrics", "https://h/metrics",
                                 "HTTPS://h/metrics", "Http://h/metrics"])
def test_http_and_https_sources_are_fetched_whatever_the_schemes_case(
        ref: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, float, int]] = []

    def get(url: str, *, deadline_s: float, max_bytes: int) -> bytes:
        asked.append((url, deadline_s, max_bytes))
        return b"vllm:num_requests_running 3\n"

    monkeypatch.setattr(httpget, "get", get)
    assert sources.read_text(ref, "engine metrics") == "vllm:num_requests_running 3\n"
    assert asked == [(ref, sources.FETCH_TIMEOUT_S, sources.MAX_BYTES)]


def test_a_file_source_is_read_as_a_file_and_a_missing_one_is_named(tmp_path: Path) -> None:
    saved = tmp_path / "https-metrics.txt"      # a file whose name merely mentions https
    saved.write_text("x 1\n")
    assert not sources.is_url(str(saved))
    assert sources.read_text(str(saved), "engine metrics") == "x 1\n"
    with pytest.raises(DoctorError, match=r"cannot read engine metrics file .*nope"):
        sources.read_text(str(tmp_path / "nope"), "engine metrics")


def test_a_body_that_is_not_utf8_is_a_doctor_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpget, "get", lambda url, **_: b"\xff\xfe")
    with pytest.raises(DoctorError, match="is not UTF-8 text"):
        sources.read_text("https://h/metrics", "daemon stats")
