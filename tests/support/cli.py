"""Running a kvtier subcommand in-process, as `kvtier CMD ARGS` would, for unit tests."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest


def run_subcommand(capsys: pytest.CaptureFixture[str], add_parser: Callable[[Any], Any],
                   command: str, *argv: str) -> tuple[int, str, str]:
    """``kvtier COMMAND ARGV`` through the subcommand's own ``add_parser``: (exit status,
    stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="kvtier")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err
