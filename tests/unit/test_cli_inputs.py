"""Bad flags on the ``kvtier`` command line: exit 2 and one line naming the flag, never a
traceback, and nothing read or computed first (the CLI in-process, through its main)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TRACE = str(FIXTURES / "traces" / "mooncake_small.jsonl")
STATS = str(FIXTURES / "doctor" / "healthy" / "stats-0.json")
NOBODY = "http://127.0.0.1:9"  # nothing listens there: a check after the fetch would say so


def kvtier(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``kvtier ARGV`` (argparse's exit included)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def the_error(err: str) -> str:
    """The one line that says what was wrong: no traceback, no usage text around it."""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("argv", "needle", "where"), [
    (["bogus"], "invalid choice: 'bogus'", "kvtier --help"),
    (["plan"], "--model", "kvtier plan --help"),
    (["stats", "--no-such-flag"], "--no-such-flag", "kvtier --help"),
    (["replay", TRACE, "--policy", "lru", "--limit", "x"], "--limit", "kvtier replay --help"),
])
def test_a_usage_error_is_one_line_pointing_at_the_help(
        capsys: pytest.CaptureFixture[str], argv: list[str], needle: str, where: str) -> None:
    code, err = kvtier(capsys, *argv)
    assert code == 2
    line = the_error(err)
    assert needle in line and f"(see '{where}')" in line, line


@pytest.mark.parametrize(("argv", "needle"), [
    (["--flops", "0"], "--flops"),
    (["--flops", "nan"], "--flops"),
    (["--flops", "inf"], "--flops"),
    (["--model-params", "-1"], "--model-params"),
    (["--bandwidth", "cpu=0"], "--bandwidth"),
    (["--bandwidth", "cpu=nan"], "--bandwidth"),
    (["--bandwidth", "cpu=-3e9"], "--bandwidth"),
    (["--bandwidth", "zzz=5e9"], "zzz"),
    (["--tier", "cpu=-5"], "--tier"),
    (["--tier", "cpu=0"], "--tier"),
    (["--tier", "cpu=2.5"], "--tier"),
    (["--tier", "cpu=nan"], "--tier"),
    (["--tier", "cpu=5", "--tier", "cpu=6"], "cpu"),
    (["--nvme-write-budget", "-5"], "--nvme-write-budget"),
    (["--nvme-write-budget", "nan"], "--nvme-write-budget"),
    (["--limit", "-1"], "--limit"),
    (["--limit", "0"], "--limit"),
    (["--layers", "0"], "--layers"),
    (["--hidden", "-4096"], "--hidden"),
    (["--bytes-per-token", "0"], "--bytes-per-token"),
    (["--block-tokens", "0"], "--block-tokens"),
])
def test_replay_refuses_meaningless_numbers(capsys: pytest.CaptureFixture[str],
                                            argv: list[str], needle: str) -> None:
    code, err = kvtier(capsys, "replay", TRACE, "--policy", "lru", *argv)
    assert code == 2
    assert needle in the_error(err)


def test_replay_write_budget_of_zero_is_a_valid_experiment(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = kvtier(capsys, "replay", TRACE, "--policy", "lru", "--tier", "cpu=1",
                       "--tier", "nvme=4", "--nvme-write-budget", "0", "--json")
    assert code == 0, err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--samples", "2", "--interval", "nan"], "--interval"),
    (["--samples", "2", "--interval", "inf"], "--interval"),
    (["--samples", "2", "--interval", "-1"], "--interval"),
    (["--samples", "1000000000"], "--samples"),
    (["--samples", "0"], "--samples"),
])
def test_doctor_refuses_meaningless_sampling(capsys: pytest.CaptureFixture[str],
                                             argv: list[str], needle: str) -> None:
    code, err = kvtier(capsys, "doctor", "--stats", STATS, *argv)
    assert code == 2
    assert needle in the_error(err)


def test_doctor_names_a_malformed_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = kvtier(capsys, "doctor", "--stats", "http://[::1", "--samples", "1")
    assert code == 2
    assert "http://[::1" in the_error(err)


@pytest.mark.parametrize("url", ["http://[::1", "127.0.0.1:8470", "ftp://host", "http://h:0",
                                 "http://h:99999"])
def test_a_malformed_daemon_url_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                 url: str) -> None:
    for command in ("stats", "explain"):
        code, err = kvtier(capsys, command, "--url", url)
        assert code == 2 and "no daemon answered" not in err
        assert "argument --url" in the_error(err)


@pytest.mark.parametrize("watch", ["-1", "0", "nan", "inf"])
def test_stats_watch_must_be_a_positive_interval(capsys: pytest.CaptureFixture[str],
                                                 watch: str) -> None:
    code, err = kvtier(capsys, "stats", "--url", NOBODY, "--watch", watch)
    assert code == 2
    assert "--watch" in the_error(err)


@pytest.mark.parametrize("limit", ["0", "-3", "100001", "999999999999"])
def test_explain_limit_is_checked_here_not_blamed_on_the_daemon(
        capsys: pytest.CaptureFixture[str], limit: str) -> None:
    code, err = kvtier(capsys, "explain", "--url", NOBODY, "--limit", limit)
    assert code == 2
    line = the_error(err)
    assert "--limit" in line and "100,000" in line and "no daemon answered" not in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpu-mem-gb", "nan"], "--gpu-mem-gb"),
    (["--gpu-mem-gb", "inf"], "--gpu-mem-gb"),
    (["--gpu-mem-gb", "1e300"], "--gpu-mem-gb"),
    (["--reserve-gb", "nan"], "--reserve-gb"),
    (["--reserve-gb", "-5"], "--reserve-gb"),
    (["--params", "inf"], "--params"),
    (["--params", "1e400"], "--params"),
    (["--params", "nan"], "--params"),
    (["--context", "inf"], "--context"),
    (["--trace-block-tokens", "0"], "--trace-block-tokens"),
])
def test_plan_refuses_non_finite_sizes(capsys: pytest.CaptureFixture[str],
                                       argv: list[str], needle: str) -> None:
    code, err = kvtier(capsys, "plan", "--model", "llama-3-8b", *argv)
    assert code == 2
    assert needle in the_error(err)


@pytest.mark.parametrize("command", ["stats", "explain"])
def test_an_ipv6_http_host_is_reached_in_brackets(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, command: str) -> None:
    """http.host = "::1" made http://::1:9, refused as "Port could not be cast": the
    command must ask [::1] (nothing listens on port 9, so it says no daemon answered)."""
    conf = tmp_path / "v6.toml"
    conf.write_text('[http]\nhost = "::1"\nport = 9\n')
    code, err = kvtier(capsys, command, "--config", str(conf))
    line = the_error(err)
    assert code != 0 and "http://[::1]:9" in line and "could not be cast" not in line
    assert "no daemon answered" in line


def test_doctor_env_asks_an_ipv6_daemon_in_brackets(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    conf = tmp_path / "v6.toml"
    conf.write_text(f'[http]\nhost = "::1"\nport = 9\n[daemon]\ndata_dir = "{tmp_path}/d"\n'
                    f'socket = "{tmp_path}/s.sock"\n[nvme]\nbytes = 0\n')
    main(["doctor", "--env", "--json", "--config", str(conf)])
    out = capsys.readouterr().out
    assert "http://[::1]:9" in out and "could not be cast" not in out
