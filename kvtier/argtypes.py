"""argparse ``type`` functions shared by the subcommands: a bad number or address is a
usage error naming the flag (exit 2) before anything is read or computed."""

from __future__ import annotations

import argparse
import math
import urllib.parse
from collections.abc import Callable
from typing import NoReturn


def _shown(text: str) -> str:
    """``text`` quoted for an error message, cut short when it is long."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high`` (None: no upper bound).
    argparse prefixes the message with the flag's name and exits 2, before anything is
    read or computed."""
    want = f"an integer of at least {low:,}" if high is None else \
        f"an integer from {low:,} to {high:,}"

    def integer(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {_shown(text)}")
        return value

    return integer


def float_in(low: float, high: float = math.inf, *, above: bool = False
             ) -> Callable[[str], float]:
    """An argparse ``type``: a finite number from ``low`` (excluded when ``above``) to
    ``high``; NaN and infinities are refused (they turn arithmetic into nonsense, a
    division by zero, or a sleep that never ends)."""
    if high == math.inf:
        want = f"a finite number {'above' if above else 'of at least'} {low:g}"
    else:
        want = f"a number {'above' if above else 'from'} {low:g} " \
               f"{'and at most' if above else 'to'} {high:g}"

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not a number") from None
        if not (math.isfinite(value) and (low < value if above else low <= value)
                and value <= high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {_shown(text)}")
        return value

    return number


def http_url(text: str) -> str:
    """An argparse ``type``: a daemon's ``http(s)://host[:port]`` address, checked before
    it is dialled, so that a typo is a usage error rather than "no daemon answered"."""
    try:
        parts = urllib.parse.urlsplit(text)
        port_ok = parts.port is None or parts.port > 0
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not an http(s)://HOST[:PORT] "
                                         "address")
    return text


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage error is one line naming the command, the problem and
    where the flags are listed, like every other start-up failure (not a page of usage
    text before it). Subparsers inherit the class through ``add_subparsers``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
