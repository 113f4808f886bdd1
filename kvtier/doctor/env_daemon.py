"""Checks of ``doctor --env`` that ask the running daemon: the clients' key functions."""

from __future__ import annotations

from typing import Any

from kvtier.doctor.env import Check, Verdict
from kvtier.keys import KEY_SCHEME


def check_key_scheme(stats: dict[str, Any] | None, why_not: str) -> Check:
    """Every connected client reports its key-function version at hello; clients hashing
    differently never share a block (zero hits across engines), so a mismatch fails."""
    if stats is None:
        return Check("key scheme", Verdict.SKIP, why_not)
    schemes = stats.get("daemon", {}).get("key_schemes", {})
    if not isinstance(schemes, dict) or not all(isinstance(n, int) for n in schemes.values()):
        return Check("key scheme", Verdict.WARN, "the daemon's stats list its clients' key "
                     "functions in an unknown form", "upgrade kvtier to the daemon's version")
    if not schemes:
        return Check("key scheme", Verdict.OK, f"no clients connected; this kvtier hashes "
                     f"with {KEY_SCHEME}")
    listed = ", ".join(f"{n} x {s}" for s, n in sorted(schemes.items()))
    other = {s for s in schemes if s not in (KEY_SCHEME, "unknown")}
    if other:
        return Check("key scheme", Verdict.FAIL, f"clients hash keys differently ({listed}; "
                     f"this kvtier: {KEY_SCHEME}): their blocks never match",
                     "upgrade every engine's kvtier connector to the daemon's version")
    if "unknown" in schemes:
        return Check("key scheme", Verdict.WARN, f"some clients do not report their key "
                     f"function ({listed}): older connectors",
                     "upgrade those engines' kvtier connector")
    return Check("key scheme", Verdict.OK, f"all clients hash with {KEY_SCHEME} ({listed})")
