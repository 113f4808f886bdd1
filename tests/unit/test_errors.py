"""Typed errors: stable codes, and the client rebuilds the class the daemon raised."""

from __future__ import annotations

import pytest

from kvtier import errors
from kvtier.errors import (
    BufferSizeError,
    CapacityError,
    ChecksumError,
    ClientForked,
    ConfigError,
    DaemonUnavailable,
    FrameError,
    HandshakeError,
    KVTierError,
    LayoutMismatch,
    LeaseError,
    LeaseExpired,
    LimitExceeded,
    Overloaded,
    ProtocolError,
    RequestTimeout,
    StartupError,
    TrustError,
    UnknownNamespace,
    UntrustedArena,
    UntrustedDaemon,
    brief,
    error_from_code,
)

# The codes cross the control socket: changing one breaks older clients.
STABLE_CODES: dict[type[KVTierError], str] = {
    KVTierError: "internal",
    ConfigError: "config",
    ProtocolError: "protocol",
    HandshakeError: "handshake",
    LayoutMismatch: "layout_mismatch",
    UnknownNamespace: "unknown_namespace",
    BufferSizeError: "buffer_size",
    LeaseError: "lease",
    LeaseExpired: "lease_expired",
    CapacityError: "capacity",
    FrameError: "frame",
    ChecksumError: "checksum",
    DaemonUnavailable: "unavailable",
    RequestTimeout: "timeout",
    Overloaded: "overloaded",
    TrustError: "untrusted",
    UntrustedDaemon: "untrusted_daemon",
    UntrustedArena: "untrusted_arena",
    StartupError: "startup",
    LimitExceeded: "limit",
    ClientForked: "forked",
}


@pytest.mark.parametrize(("cls", "code"), list(STABLE_CODES.items()),
                         ids=[c.__name__ for c in STABLE_CODES])
def test_codes_are_stable(cls: type[KVTierError], code: str) -> None:
    assert cls.code == code


@pytest.mark.parametrize("cls", list(STABLE_CODES), ids=lambda c: c.__name__)
def test_error_from_code_rebuilds_the_exact_class(cls: type[KVTierError]) -> None:
    err = error_from_code(cls.code, "what went wrong")
    assert type(err) is cls
    assert str(err) == "what went wrong"
    assert isinstance(err, KVTierError)


def test_every_error_class_in_the_module_has_a_unique_code() -> None:
    classes = [obj for obj in vars(errors).values()
               if isinstance(obj, type) and issubclass(obj, KVTierError)]
    assert set(classes) == set(STABLE_CODES)
    assert len({c.code for c in classes}) == len(classes)


def test_subclasses_keep_their_parents_catchable() -> None:
    assert isinstance(error_from_code("checksum", "x"), FrameError)
    assert isinstance(error_from_code("handshake", "x"), ProtocolError)
    assert isinstance(error_from_code("lease_expired", "x"), LeaseError)


@pytest.mark.parametrize("code", ["", "no_such_code", "INTERNAL", "lease "])
def test_unknown_codes_become_the_base_class(code: str) -> None:
    err = error_from_code(code, "msg")
    assert type(err) is KVTierError
    assert str(err) == "msg"


def test_errors_defined_in_other_modules_are_rebuilt_too() -> None:
    from kvtier.tiers.nvme import NvmeIOError

    assert type(error_from_code(NvmeIOError.code, "EIO")) is NvmeIOError


def test_a_subclass_without_its_own_code_does_not_steal_its_parents() -> None:
    class SpecialLease(LeaseError):
        pass

    assert SpecialLease.code == "lease"
    assert type(error_from_code("lease", "x")) is LeaseError


@pytest.mark.parametrize(("value", "text"), [
    ("abc", "'abc'"),
    (b"\x00\x01", "b'\\x00\\x01'"),
    (None, "None"),
    (True, "True"),
    (2.5, "2.5"),
    (-7, "-7"),
    (2**70, "an int of 71 bits"),
    ([1, 2, 3], "a list of 3 items"),
    ({"a": 1}, "a dict of 1 items"),
    (object(), "a object"),
])
def test_brief_names_a_value_shortly(value: object, text: str) -> None:
    assert brief(value) == text


@pytest.mark.parametrize("value", ["x" * (16 << 20), b"\xff" * (16 << 20),
                                   bytearray(16 << 20)])
def test_brief_cuts_long_values_before_rendering_them(value: object) -> None:
    text = brief(value)
    assert len(text) == 64 and text.endswith("...")
    assert len(brief(value, 20)) == 20
