"""Every ``kvtier_*`` metric family, ``section.key`` setting and ``KVTIER_*`` variable that
README.md and docs/*.md name exists in the code. Operators copy these names into alerts,
dashboards, TOML files and unit files, where a stale one fails silently (an empty panel, a
setting ignored). The metric names come from the real collectors, run on a stats snapshot
that reaches every family; settings and variables from the config tree."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, get_type_hints

from kvtier.config import ENV_ALIASES, TRUSTED_UIDS_ENV, Config
from kvtier.daemon.engines import COUNTERS as ENGINE_COUNTERS
from kvtier.daemon.engines import GAUGES as ENGINE_GAUGES
from kvtier.daemon.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")

# Named on purpose though not a setting, metric or variable of kvtier's: keep this short.
EXCEPTIONS = {
    # /v1/stats fields and sections, not settings
    "policy.lookups_dropped", "daemon.gc",
}

# A snapshot that makes every collector branch yield its families (counters the tiers
# report only sometimes, the nvme budget and files, gc, the adaptive policy, engines).
SNAPSHOT: dict[str, Any] = {
    "tiers": {"nvme": {"redirects": 0, "open_files": 0}},
    "daemon": {"gc": {"frozen": 0, "frozen_since": 0, "full_collections": 0,
                      "last_full_s": 0.0}},
    "admission": {"nvme_write_budget": {"bytes_per_s": 0, "available_bytes": 0.0}},
    "policy": {"lookups_dropped": 0, "tiers": {"cpu": {}}},
    "connector": dict.fromkeys((*ENGINE_GAUGES, *ENGINE_COUNTERS), 0.0),
}


def mentions(pattern: str) -> list[tuple[str, str]]:
    """(``file:line``, match) for each match of ``pattern`` in the docs."""
    return [(f"{doc.relative_to(ROOT)}:{n}", m.group(0))
            for doc in DOCS for n, line in enumerate(doc.read_text().splitlines(), 1)
            for m in re.finditer(pattern, line)]


def known(name: str, names: set[str]) -> bool:
    """``name`` is one of ``names``; a name ending in ``_`` (``KVTIER_DAEMON_<FIELD>``,
    ``kvtier_requests_*_total``) is a prefix of one."""
    return any(n.startswith(name) for n in names) if name.endswith("_") else name in names


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def test_docs_name_only_exported_metric_families() -> None:
    families = {m.name for m in Metrics(lambda: SNAPSHOT).registry.collect()}
    named = mentions(r"(?<![\w/.-])kvtier_[a-z0-9_]+")
    assert len(named) > 50, "the pattern no longer finds the docs' metric names"
    unknown = [(at, n) for at, n in named
               if n not in EXCEPTIONS and not known(family(n), families)]
    assert not unknown, unknown


def settings() -> dict[str, set[str]]:
    return {section: {f.name for f in dataclasses.fields(tree)}
            for section, tree in get_type_hints(Config).items()}


def test_docs_name_only_settings_of_the_config_tree() -> None:
    tree = settings()
    # section.key, not a longer dotted path (/v1/stats fields: daemon.gc.frozen,
    # policy.tiers.<tier>) nor part of a module or file name (kvtier.daemon.gc_guard)
    named = mentions(rf"(?<![\w/.-])(?:{'|'.join(tree)})\.[a-z_][a-z0-9_]*\b(?![.(/-]?[\w<])")
    assert len(named) > 50, "the pattern no longer finds the docs' settings"
    unknown = []
    for at, dotted in named:
        section, key = dotted.split(".")
        module = ROOT / "kvtier" / section / f"{key}.py"   # kvtier.policy.mrc, as policy.mrc
        if key not in tree[section] and dotted not in EXCEPTIONS and not module.exists():
            unknown.append((at, dotted))
    assert not unknown, unknown


def read_variables() -> set[str]:
    """``KVTIER_*`` variables the repository's code, tests and scripts read by name."""
    found: set[str] = set()
    for top in ("kvtier", "connectors", "tests", "scripts", "benchmarks"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".sh"):
                found |= set(re.findall(r"(?:environ(?:\.get)?[(\[]\s*[\"']|\$\{?)"
                                        r"(KVTIER_[A-Z0-9_]+)", path.read_text()))
    return found


def test_docs_name_only_variables_kvtier_reads() -> None:
    variables = {f"KVTIER_{section.upper()}_{key.upper()}"
                 for section, keys in settings().items() for key in keys}
    variables |= set(ENV_ALIASES) | {TRUSTED_UIDS_ENV} | read_variables()
    named = mentions(r"(?<![\w$])KVTIER_[A-Z0-9_]*")
    assert len(named) > 10, "the pattern no longer finds the docs' variables"
    unknown = [(at, n) for at, n in named if n not in EXCEPTIONS and not known(n, variables)]
    assert not unknown, unknown
