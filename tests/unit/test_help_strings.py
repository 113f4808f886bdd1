"""Every benchmark's and command's ``--help`` formats: argparse expands ``%`` in help
strings, so a bare ``+-4%`` crashed ``bench_vllm_multiturn.py --help`` with a ValueError."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["benchmarks/*.py", "kvtier/**/*.py", "scripts/*.py", "connectors/**/*.py"]
# what argparse's help expansion accepts: %% and %(name)s-style specifiers
_OK = re.compile(r"%%|%\(\w+\)[-#0 +]*\d*(?:\.\d+)?[sdrifgeExXo]")


def _help_texts(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("help", "description", "epilog"):
                    try:
                        value = ast.literal_eval(kw.value)
                    except ValueError:
                        continue
                    if isinstance(value, str):
                        out.append((node.lineno, value))
    return out


def test_help_strings_expand() -> None:
    paths = sorted(p for pattern in SOURCES for p in ROOT.glob(pattern))
    assert len(paths) > 50
    bad = [f"{p.relative_to(ROOT)}:{line}: {text!r}"
           for p in paths for line, text in _help_texts(ast.parse(p.read_text()))
           if "%" in _OK.sub("", text)]
    assert not bad, "bare % in argparse help (write %%):\n" + "\n".join(bad)
