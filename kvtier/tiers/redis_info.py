"""What the Redis tier reads of its servers' INFO and DBSIZE replies (``RedisLink``'s
health rounds): memory used, its limit and the key count, summed over the masters.

A reply is a server's word, not a fact: a field that is not a byte count (letters, a sign,
more than 20 digits) is ignored (logged once), a DBSIZE that is not a plain integer counts
0, so a bad server cannot make the tier's gauges, or its monitor, fail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtier.tiers.redis")


@dataclass(slots=True)
class ServerStats:
    """The masters' memory used, their memory limit and their keys (from the last round
    that heard every master)."""

    used: int = 0
    limit: int = 0
    keys: int = 0
    bad_logged: bool = False   # an INFO field that was not a number was logged once

    def take(self, answers: list[list[Any]]) -> None:
        """Sum ``[PING, INFO memory, DBSIZE]`` answers, one per master. The limit is the
        sum of the masters' ``maxmemory`` only when every master has one: a master without
        (0, or a field that is not a number) can take any amount, so the whole is
        unbounded (0), not the others' sum."""
        used = limit = keys = 0
        bounded = bool(answers)
        for answer in answers:
            info = info_fields(answer[1])
            used += self._number(info, "used_memory")
            cap = self._number(info, "maxmemory")
            bounded = bounded and cap > 0
            limit += cap
            keys += key_count(answer[2])
        self.used, self.limit, self.keys = used, limit if bounded else 0, keys

    def _number(self, info: dict[str, str], name: str) -> int:
        """INFO field ``name`` as a byte count: 0 when absent, and when it is not one (not
        decimal digits, or more than 20 of them): ignored, logged once per tier."""
        text = info.get(name, "0").strip()
        if text.isascii() and text.isdigit() and len(text) <= 20:
            return int(text)
        if not self.bad_logged:
            self.bad_logged = True
            log.warning("redis tier: INFO field %s is not a byte count (%r): ignored",
                        name, text[:40])
        return 0


def key_count(reply: Any) -> int:
    """A DBSIZE reply as a key count (0 when it is not one)."""
    if isinstance(reply, int) and not isinstance(reply, bool) and 0 <= reply < 1 << 63:
        return reply
    return 0


def info_fields(reply: Any) -> dict[str, str]:
    """An INFO reply's ``name:value`` lines."""
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else ""
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
