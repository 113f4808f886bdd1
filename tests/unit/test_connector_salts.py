"""A request's namespace salt: its tenant's cache_salt and its LoRA adapter, one to one.
Once the adapter's name was appended to the salt as text, so a tenant could pick a salt
that named another tenant's adapter namespace (and fill it with base-model KV)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

import numpy as np

# (imported at collection: vLLM's first import of these runs a subprocess, py-cpuinfo's)
from kvtier.connectors.vllm.metadata import TransferSpec
from kvtier.connectors.vllm.salts import namespace_salt, request_salt
from kvtier.connectors.vllm.transfers import SaveRequest

from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout


def request(salt: str | None = None, lora: tuple[str, str, int] | None = None) -> Any:
    adapter = None if lora is None else SimpleNamespace(
        lora_name=lora[0], lora_path=lora[1], lora_int_id=lora[2])
    return SimpleNamespace(cache_salt=salt, lora_request=adapter, mm_features=None,
                           prompt_embeds=None)


FOO = ("foo", "/adapters/foo", 1)


def derived_salt(req: Any) -> str:
    """The salt kvtier derives for ``req`` (a tenant may send it as its own cache_salt)."""
    salt = request_salt(req)
    assert isinstance(salt, str)
    return salt


@pytest.mark.parametrize(("a", "b"), [
    (request("|lora:foo"), request(None, FOO)),           # the old text form collided
    (request("acme|lora:foo"), request("acme", FOO)),
    (request(None, FOO), request("", FOO)),               # no salt is not an empty salt
    (request("t", FOO), request("t", ("foo", "/adapters/foo-v2", 1))),   # reloaded weights
    (request("t", FOO), request("t", ("foo", "/adapters/foo", 2))),
    (request(derived_salt(request("t", FOO))), request("t", FOO)),   # a derived salt, chosen
])
def test_different_tenants_or_adapters_never_share_a_salt(a: Any, b: Any) -> None:
    assert request_salt(a) != request_salt(b)


def test_an_adapter_retrained_in_place_gets_another_salt(tmp_path: Any) -> None:
    """Same name, path and id, new weights (a new process reads them): another namespace,
    so the old adapter's KV is never served to the new one."""
    from kvtier.connectors.vllm import salts

    adapter = tmp_path / "foo"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 16)
    lora = ("foo", str(adapter), 7)
    first = request_salt(request("t", lora))
    assert request_salt(request("t", lora)) == first          # read once, remembered
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 16)
    salts._ADAPTER_FINGERPRINTS.clear()                    # a new engine process
    retrained = request_salt(request("t", lora))
    (adapter / "adapter_config.json").write_text('{"r": 16, "lora_alpha": 16}')
    salts._ADAPTER_FINGERPRINTS.clear()
    rank_changed = request_salt(request("t", lora))
    assert len({first, retrained, rank_changed}) == 3


def test_an_adapter_changed_on_disk_under_a_running_engine_is_not_cached(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Same name, path and id, files replaced while the engine runs: vLLM goes on with the
    version it loaded until its LoRA cache drops it, then reads the new files, so which
    version computes a request is unknown. Its requests are neither loaded nor saved for the
    rest of the process (before, the fingerprint read first was kept, and after vLLM
    reloaded the adapter the old version's KV was served to the new: wrong tokens, found by
    review). Other adapters are unaffected; a new process fingerprints the new files."""
    from kvtier.connectors.vllm import salts

    def make(name: str, payload: bytes) -> Any:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
        (d / "adapter_model.safetensors").write_bytes(payload)
        return d

    x, y = make("x", bytes(range(256)) * 16), make("y", bytes(range(1, 256)) * 16)
    lx, ly = ("x", str(x), 3), ("y", str(y), 4)
    salts._ADAPTER_FINGERPRINTS.clear()
    first = request_salt(request("t", lx))
    assert isinstance(first, str) and request_salt(request("t", lx)) == first
    other = request_salt(request("t", ly))
    (x / "adapter_model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 16)
    with caplog.at_level("WARNING", logger="kvtier.connectors.vllm"):
        assert request_salt(request("t", lx)) is False
        assert request_salt(request("t", lx)) is False
    assert sum("changed on disk" in r.getMessage() for r in caplog.records) == 1
    assert request_salt(request("t", ly)) == other
    (x / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 16)   # put back
    assert request_salt(request("t", lx)) is False      # still unknown which vLLM runs
    salts._ADAPTER_FINGERPRINTS.clear()                 # a new engine process
    assert request_salt(request("t", lx)) == first


def test_without_an_adapter_the_tenants_salt_is_kept() -> None:
    """What engines stored before keeps its namespace."""
    assert request_salt(request("acme")) == "acme"
    assert request_salt(request(None)) is None
    assert namespace_salt("\x1facme", None) != "\x1facme"   # only the reserved start changes
    assert request_salt(request("t", FOO)) == request_salt(request("t", FOO))


def test_a_save_that_continues_a_chain_names_its_parent_and_depth() -> None:
    """Blocks 2..3 of a prompt whose blocks 0..1 were stored before: the put says where in
    the chain they sit (the daemon's policy keeps a parent as long as its children)."""
    ns = Namespace("m", KVLayout(2, 2, 32, "float16", 16))
    tokens = np.arange(4 * 16, dtype=np.int64)
    asked: list[tuple[Any, ...]] = []

    class Client:
        def prepare_put(self, ns_: Any, keys: Any, *, parent: Any = None,
                        start_depth: int = 0) -> None:
            asked.append((list(keys), parent, start_depth))

    class Link:
        def namespace(self, salt: Any, rank: int) -> Namespace:
            return ns

        def call(self, fn: Any, default: Any) -> Any:
            return fn(Client())

    spec = TransferSpec("r", None, tokens, first_block=2, pages=[[4], [5]])
    assert SaveRequest(spec, None, Link, 0).prepare() is False   # type: ignore[arg-type]
    chain = block_keys(ns, tokens)
    assert asked == [(chain[2:4], chain[1], 2)]


def test_a_weights_generation_gives_every_request_another_salt() -> None:
    """After an in-place weight update (``SchedulerSide.reset_cache``) no salt of before,
    nor one a tenant can choose, names the new generation's namespaces."""
    gen = "0123456789abcdef"
    for req in (request(None), request("t"), request("t", FOO)):
        after = request_salt(req, gen)
        assert isinstance(after, str)
        assert after != request_salt(req)
        assert after != request_salt(request(after))               # a tenant choosing it
        assert request_salt(req, "another") != after
    assert request_salt(request(None), gen) != request_salt(request(""), gen)


def test_a_salt_the_daemon_cannot_take_is_not_cached(caplog: pytest.LogCaptureFixture) -> None:
    """A lone surrogate in a tenant's salt raised out of vLLM's scheduler (the request
    stayed queued: the engine failed every step after), and a salt over the daemon's 1024
    characters, or one an adapter's long path makes that long, was refused by the daemon
    at register_layout (found by review): such a request is not cached, said once."""
    assert request_salt(request("\ud800x")) is False
    assert request_salt(request(7)) is False      # type: ignore[arg-type]
    assert request_salt(request("s" * 1025)) is False
    assert request_salt(request("s" * 1024)) == "s" * 1024
    assert request_salt(request("t", ("foo", "/p" * 600, 1))) is False
    long_gen = request_salt(request("s" * 1000), "0123456789abcdef")
    assert long_gen is False                       # the derived salt is what counts
    assert caplog.text.count("is not cached") == 1
