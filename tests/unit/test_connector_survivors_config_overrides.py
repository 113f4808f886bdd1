"""What a callable ``hf_overrides`` does, as its digest (``overrides.callable_digest``;
mutation review survivors): every part of what it does counts (its code and constants,
arguments bound by a partial, closures, defaults, a bound method's object, a callable
object's state, the module-level values and own-module helpers it names), and nothing
that differs between processes (an object's address) does."""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.overrides import callable_digest


def override(cfg: Any, *args: Any, **kw: Any) -> Any:
    return cfg


def differ(a: Any, b: Any) -> bool:
    return callable_digest(a) != callable_digest(b)


def test_a_partial_s_arguments_count() -> None:
    assert differ(functools.partial(override, 1), functools.partial(override, 2))
    assert differ(functools.partial(override, k=1), functools.partial(override, k=2))
    assert differ(functools.partial(override, {"rope": 1}),
                  functools.partial(override, {"rope": 2}))
    assert differ(functools.partial(override, b"ab"), functools.partial(override, b"cd"))
    assert not differ(functools.partial(override, 1), functools.partial(override, 1))


def test_a_partial_of_another_function_differs() -> None:
    def other(cfg: Any) -> Any:
        cfg.x = 1
        return cfg

    assert differ(functools.partial(override, 1), functools.partial(other, 1))


def test_code_constants_closures_and_defaults_count() -> None:
    assert differ(lambda c: c * 2, lambda c: c * 3)          # constants
    assert differ(lambda a, b: a + b, lambda a, b: a - b)    # bytecode alone

    def factory(eps: float) -> Any:
        return lambda c: setattr(c, "eps", eps)

    assert differ(factory(0.1), factory(0.2))                # closures

    def with_default(c: Any, eps: float = 0.1) -> Any:
        return eps

    def with_kwdefault(c: Any, *, eps: float = 0.1) -> Any:
        return eps

    other_default = types.FunctionType(with_default.__code__, with_default.__globals__,
                                       "with_default", (0.2,))
    assert differ(with_default, other_default)
    other_kw = types.FunctionType(with_kwdefault.__code__, with_kwdefault.__globals__,
                                  "with_kwdefault")
    other_kw.__kwdefaults__ = {"eps": 0.2}
    assert differ(with_kwdefault, other_kw)


class Scaler:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def apply(self, cfg: Any) -> Any:
        cfg.factor = self.factor
        return cfg

    def __call__(self, cfg: Any) -> Any:
        return self.apply(cfg)

    @staticmethod
    def double(cfg: Any) -> Any:
        return cfg * 2

    @staticmethod
    def triple(cfg: Any) -> Any:
        return cfg * 3


def test_a_bound_method_s_object_and_a_callable_object_s_state_count() -> None:
    assert differ(Scaler(1.0).apply, Scaler(2.0).apply)
    assert differ(Scaler(1.0), Scaler(2.0))
    assert not differ(Scaler(1.0), Scaler(1.0))
    assert differ(vars(Scaler)["double"], vars(Scaler)["triple"])   # as staticmethods


def module_with(helper_body: str, value: int) -> types.ModuleType:
    """A module whose ``override`` names a module-level ``EPS`` and an own ``helper``,
    nested in a lambda."""
    mod = types.ModuleType("hf_overrides_mod")
    exec(f"EPS = {value}\n"
         f"def helper(c):\n    return {helper_body}\n"
         "def override(c):\n    return (lambda d: helper(d) + EPS)(c)\n", mod.__dict__)
    return mod


def test_module_level_values_and_own_helpers_it_names_count() -> None:
    base = module_with("c * 2", 1)
    assert differ(base.override, module_with("c * 2", 2).override)   # EPS
    assert differ(base.override, module_with("c * 3", 1).override)   # its helper's code
    assert not differ(base.override, module_with("c * 2", 1).override)


class Plain:
    """An object whose text has its address in it."""


def test_an_object_s_address_does_not_count() -> None:
    a, b = Plain(), Plain()
    assert "0x" in str(a)
    assert not differ(functools.partial(override, a), functools.partial(override, b))

