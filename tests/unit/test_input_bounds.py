"""Inputs with a unit or range that were taken but meant nothing, or refused without a
reason: ``1PiB``/``1P`` (the size pattern took p, the unit table did not: refused, saying
that units go up to T), an
unbounded ``kvtier plan --concurrency`` (10**24 printed a 10**20 GB plan), and an
``nvme.bytes`` below one page (a tier that could hold no block)."""

from __future__ import annotations

import argparse

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.plan import add_parser
from kvtier.plan.planner import MAX_CONCURRENCY
from kvtier.units import parse_size


@pytest.mark.parametrize("text", ["1PiB", "1P", "2pb", "1.5Pi"])
def test_peta_sizes_are_refused_saying_why(text: str) -> None:
    with pytest.raises(ConfigError, match="units go up to TiB and TB, so 1PiB is 1024TiB"):
        parse_size(text)
    assert parse_size("1024TiB") == 2**50


@pytest.mark.parametrize("value", ["0", "-1", str(MAX_CONCURRENCY + 1), "10" + "0" * 24])
def test_plan_concurrency_is_bounded(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvtier")
    add_parser(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as ex:
        parser.parse_args(["plan", "--model", "llama-3-8b", "--concurrency", value])
    assert ex.value.code == 2
    assert "--concurrency: must be an integer from 1 to 10,000,000" in capsys.readouterr().err


@pytest.mark.parametrize("nbytes", ["1", "4095"])
def test_nvme_bytes_below_a_page_is_refused(nbytes: str) -> None:
    with pytest.raises(ConfigError, match=f"nvme.bytes must be 0 .* got {nbytes}"):
        load_config(None, env={}, overrides={"nvme.bytes": nbytes})


def test_nvme_bytes_of_a_page_or_zero_is_taken() -> None:
    assert load_config(None, env={}, overrides={"nvme.bytes": "4096"}).nvme.bytes == 4096
    assert load_config(None, env={}, overrides={"nvme.bytes": "0"}).nvme.bytes == 0
