"""kvtier.ui: tables whose lines start with their first cell, markup never interpreted, a
progress bar only when asked for."""

from __future__ import annotations

import io

from kvtier import ui


def test_table_lines_start_with_the_first_cell_and_keep_brackets() -> None:
    buf = io.StringIO()
    ui.console(buf).print(ui.table(["name", "n"], [["P50", "2,048"], ["[madvise]", "7"]],
                                   right=(1,)))
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("name") and lines[1].startswith("P50")
    assert lines[2].startswith("[madvise]")          # escaped, not eaten as markup
    assert lines[1].rstrip().endswith("2,048") and "\x1b[" not in buf.getvalue()


def test_progress_is_a_no_op_unless_enabled() -> None:
    buf = io.StringIO()
    with ui.progress(10, "x", enabled=False, file=buf) as advance:
        advance(5)
    assert buf.getvalue() == ""
    with ui.progress(10, "replay lru", enabled=True, file=buf) as advance:
        advance(10)
    assert "replay lru" in buf.getvalue() and "10/10" in buf.getvalue()
