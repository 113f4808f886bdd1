"""JSON from outside (a file, a daemon's answer, a trace line): what ``json`` refuses, each
as one phrase, so that every reader says it in one line instead of a traceback."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """``json.loads``; ValueError whose message says what is wrong: not JSON (where), bytes
    that are not UTF-8 (or UTF-16/32) text, nested too deeply (RecursionError in the
    parser), or an integer over Python's digit limit."""
    try:
        return json.loads(text)
    except UnicodeDecodeError:   # a ValueError too: caught before the catch-all below
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError:   # json's only other refusal
        raise ValueError("an integer too long to read") from None
