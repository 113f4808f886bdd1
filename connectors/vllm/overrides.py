"""What a callable ``hf_overrides`` does, as a digest every process of an engine computes
alike: part of the weights fingerprint (``config.engine_fingerprint``).

Its name alone is not enough: a factory's inner functions share one (every lambda too),
and two engines whose overrides changed the model differently shared KV and gave wrong
tokens. The config it made is not a stable key either: the scheduler side and the
workers each derive the model id in their own process, and vLLM's model loading changes
the workers' copy of the config (EAGLE drafts set ``target_layer_count``, Falcon and
Llama 4 fill fields in), so the two sides named different namespaces and nothing saved
was ever found (both found by review). The digest is of the callable itself: its code
(bytecode, constants, names, defaults), the values it closes over and the module-level
values it names (``EPS = 0.5`` read by the function: two engines whose module set it
differently computed different KV under one name), or a ``functools.partial``'s function
and arguments, written without addresses and with sets sorted, so it is the same in every
process and across restarts. A module or a class it names counts by its name, a function
of another module by its module and name (following library code would cost much and say
little), a function of its own module by what it does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import types
from typing import Any

MAX_DEPTH = 6   # nested callables followed (closures, partials, code constants)


def callable_digest(fn: Any) -> str:
    """A digest of what ``fn`` does (see the module docstring)."""
    text = json.dumps(_describe(fn, 0), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def plain_value(value: Any) -> Any:
    """``value`` as JSON every process writes alike (settings given as objects)."""
    return _plain(value, 0)


def _describe(fn: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        return "..."
    if isinstance(fn, functools.partial):
        return {"partial": _describe(fn.func, depth + 1), "args": _plain(fn.args, depth),
                "keywords": _plain(fn.keywords, depth)}
    if isinstance(fn, (staticmethod, classmethod)):
        return _describe(fn.__func__, depth + 1)
    if isinstance(fn, types.MethodType):
        return {"method": _describe(fn.__func__, depth + 1),
                "self": _plain(getattr(fn.__self__, "__dict__", None), depth)}
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):   # a callable object: its type and state
        call = vars(type(fn)).get("__call__")   # (a Python class's; a builtin has none)
        return {"object": type(fn).__qualname__, "text": None if call else _text(fn),
                "state": _plain(getattr(fn, "__dict__", None), depth),
                "call": _describe(call, depth + 1) if call is not None else None}
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(_plain(cell.cell_contents, depth))
        except ValueError:   # an empty cell
            cells.append(None)
    return {"name": getattr(fn, "__qualname__", ""), "code": _code(code, depth),
            "defaults": _plain(getattr(fn, "__defaults__", None), depth),
            "kwdefaults": _plain(getattr(fn, "__kwdefaults__", None), depth),
            "closure": cells, "globals": _globals(fn, code, depth)}


def _globals(fn: Any, code: types.CodeType, depth: int) -> dict[str, Any]:
    """The module-level values ``code`` (and the code nested in it) names."""
    space = getattr(fn, "__globals__", None)
    if not isinstance(space, dict) or depth >= MAX_DEPTH:
        return {}
    module = space.get("__name__")
    found: dict[str, Any] = {}
    for name in sorted(_names(code, 0)):
        if name not in space:   # a builtin, or an attribute's name
            continue
        value = space[name]
        if isinstance(value, (types.ModuleType, type)):
            found[name] = getattr(value, "__name__", name)
        elif callable(value) and getattr(value, "__module__", module) != module:
            where = getattr(value, "__module__", "")
            found[name] = f"{where}.{getattr(value, '__qualname__', name)}"
        elif value is not fn:
            found[name] = _plain(value, depth + 1)
    return found


def _names(code: types.CodeType, depth: int) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and depth < MAX_DEPTH:
            names |= _names(const, depth + 1)
    return names


def _code(code: types.CodeType, depth: int) -> Any:
    return {"bytecode": code.co_code.hex(), "names": list(code.co_names),
            "consts": [_code(c, depth + 1) if isinstance(c, types.CodeType) and depth < MAX_DEPTH
                       else _plain(c, depth) for c in code.co_consts]}


def _plain(value: Any, depth: int) -> Any:
    """``value`` as JSON every process writes alike: dict keys as text, sets sorted,
    callables described, other objects by their text without addresses."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if depth > MAX_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v, depth + 1) for v in value), key=lambda v: json.dumps(
            v, sort_keys=True))
    if isinstance(value, types.CodeType):
        return _code(value, depth + 1)
    if callable(value):
        return _describe(value, depth + 1)
    return _text(value)


def _text(value: Any) -> str:
    text = str(value)
    return type(value).__qualname__ if " at 0x" in text else text
