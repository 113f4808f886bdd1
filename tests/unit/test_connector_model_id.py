"""The model id the connector registers: vLLM's model name (or ``model_id``), prefixed by
``namespace``, with the weights fingerprint appended (``model_fingerprint``)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.errors import ConfigError

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.config import ConnectorConfig


def model_id(calls: list[int] | None = None, **extra: object) -> str:
    def weights() -> str:
        if calls is not None:
            calls.append(1)
        return "0123456789abcdef"

    return ConnectorConfig.from_extra(dict(extra), block_size=16, default_model_id="org/m",
                                      weights=weights).model_id


def test_the_weights_fingerprint_is_appended_unless_turned_off() -> None:
    calls: list[int] = []
    assert model_id(calls) == "org/m#w=0123456789abcdef"
    assert model_id(calls, model_id="x", namespace="prod") == "prod/x#w=0123456789abcdef"
    assert model_id(calls, model_fingerprint="off") == "org/m"
    assert model_id(calls, model_fingerprint="rev-2026-12") == "org/m#w=rev-2026-12"
    assert len(calls) == 2          # computed only when asked for ("auto")
    assert ConnectorConfig.from_extra({}, block_size=16, default_model_id="org/m"
                                      ).model_id == "org/m"   # nothing to fingerprint


@pytest.mark.parametrize("bad", ["", 3, None, "a#w=b"])
def test_a_bad_model_fingerprint_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="model_fingerprint"):
        model_id(model_fingerprint=bad)


def test_a_draft_models_weights_count_too(tmp_path: Any) -> None:
    """A speculative draft's layers share the engine's KV pages: other draft weights,
    another fingerprint; the target alone fingerprints as before (no draft, no change)."""
    from types import SimpleNamespace

    from kvtier.connectors.vllm.fingerprint import engine_fingerprint

    from kvtier.weights import fingerprint

    def checkpoint(name: str, payload: bytes) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(payload)
        return str(d)

    def config(path: str) -> Any:
        return SimpleNamespace(model=path, revision=None, dtype="torch.bfloat16",
                               quantization=None, hf_overrides={})

    target = config(checkpoint("target", b"t" * 4096))
    alone = engine_fingerprint(target)
    assert alone == fingerprint(target.model, dtype="bfloat16")
    assert engine_fingerprint(target, SimpleNamespace(method="ngram",
                                                      draft_model_config=None)) == alone
    fps = {engine_fingerprint(target, SimpleNamespace(
        method="eagle", draft_model_config=config(checkpoint(name, payload))))
        for name, payload in (("d1", b"a" * 4096), ("d2", b"b" * 4096))}
    assert len(fps) == 2 and alone not in fps


def test_settings_that_change_the_kv_of_the_same_weights_count_too(tmp_path: Any) -> None:
    """Each of these gave a fresh engine another engine's KV and wrong tokens: two fp8
    formats (both stored as uint8), a config given apart from the checkpoint, and a
    LongRoPE model's ``max_model_len`` (which picks the rope factors of every token)."""
    from types import SimpleNamespace

    from kvtier.connectors.vllm.fingerprint import engine_fingerprint

    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"w" * 4096)

    def config(**kw: Any) -> Any:
        base: dict[str, Any] = dict(model=str(ckpt), revision=None, dtype="float32",
                                    quantization=None, hf_overrides={}, max_model_len=4096,
                                    hf_config_path=None, hf_text_config=None)
        return SimpleNamespace(**{**base, **kw})

    def cache(dtype: str) -> Any:
        return SimpleNamespace(cache_dtype=dtype)

    plain = engine_fingerprint(config())
    assert engine_fingerprint(config(), None, cache("auto")) == plain
    fp8 = {engine_fingerprint(config(), None, cache(d)) for d in ("fp8_e4m3", "fp8_e5m2")}
    assert len(fp8) == 2 and plain not in fp8

    other = tmp_path / "alt"
    other.mkdir()
    (other / "config.json").write_text('{"rope_theta": 50}')
    alt = engine_fingerprint(config(hf_config_path=str(other)))
    assert alt != plain
    assert engine_fingerprint(config(hf_config_path=str(ckpt))) == plain   # its own

    rope = SimpleNamespace(rope_parameters={
        "rope_type": "longrope", "original_max_position_embeddings": 256,
        "short_factor": [1.0], "long_factor": [4.0]})
    short = engine_fingerprint(config(hf_text_config=rope, max_model_len=256))
    long_ = engine_fingerprint(config(hf_text_config=rope, max_model_len=4096))
    assert short != long_
    assert engine_fingerprint(config(hf_text_config=rope, max_model_len=8192)) == long_
    llama3 = SimpleNamespace(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert engine_fingerprint(config(hf_text_config=llama3, max_model_len=256)) == \
        engine_fingerprint(config(hf_text_config=llama3, max_model_len=8192))


def test_a_load_format_that_does_not_read_the_files_counts(tmp_path: Any) -> None:
    """An engine started with ``load_format="dummy"`` runs random weights whatever the
    checkpoint holds: its KV was loaded by engines serving the real checkpoint (found by
    review, wrong tokens). Formats that read the checkpoint's files (auto, safetensors, ...)
    agree, as the files decide; any other format counts with its loader settings."""
    from types import SimpleNamespace

    from kvtier.connectors.vllm.fingerprint import engine_fingerprint

    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"w" * 4096)
    model = SimpleNamespace(model=str(ckpt), revision=None, dtype="float32", quantization=None,
                            hf_overrides={}, max_model_len=4096, hf_config_path=None,
                            hf_text_config=None)

    def load(fmt: str, extra: Any = None) -> Any:
        return SimpleNamespace(load_format=fmt, model_loader_extra_config=extra or {})

    real = engine_fingerprint(model)
    for fmt in ("auto", "safetensors", "SafeTensors", "pt", "mistral"):
        assert engine_fingerprint(model, None, None, load(fmt)) == real, fmt
    dummy = engine_fingerprint(model, None, None, load("dummy"))
    assert dummy != real
    assert engine_fingerprint(model, None, None, load("dummy")) == dummy   # deterministic
    a = engine_fingerprint(model, None, None, load("tensorizer", {"tensorizer_uri": "s3://a"}))
    b = engine_fingerprint(model, None, None, load("tensorizer", {"tensorizer_uri": "s3://b"}))
    assert len({real, dummy, a, b}) == 4


def test_settings_that_load_other_weights_or_code_from_the_same_files_count(
        tmp_path: Any) -> None:
    """Each of these makes other weights or other model code from the same checkpoint
    files: weights streamed from an object store URI (``model_weights``: the local
    directory holds the config only), online quantization's settings, another model class,
    and with ``trust_remote_code`` the model's own Python files. Unset, the fingerprint is
    what it was (engines keep their namespace)."""
    from types import SimpleNamespace

    from kvtier.connectors.vllm.fingerprint import engine_fingerprint

    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"w" * 4096)
    (ckpt / "modeling_tiny.py").write_text("SCALE = 1.0\n")

    def config(**kw: Any) -> Any:
        base: dict[str, Any] = dict(model=str(ckpt), revision=None, dtype="float32",
                                    quantization=None, hf_overrides={}, max_model_len=4096,
                                    hf_config_path=None, hf_text_config=None)
        return SimpleNamespace(**{**base, **kw})

    plain = engine_fingerprint(config())
    unset: dict[str, Any] = dict(model_weights="", quantization_config=None,
                                 model_class_overrides={}, trust_remote_code=False,
                                 code_revision=None)
    assert engine_fingerprint(config(**unset)) == plain
    assert engine_fingerprint(config(model_weights=str(ckpt))) == plain   # its own files
    uris = {engine_fingerprint(config(model_weights=f"s3://bucket/{w}")) for w in "ab"}
    quants = {engine_fingerprint(config(quantization="fp8", quantization_config=q))
              for q in ({"linear": "fp8"}, {"linear": "fp8", "ignore": ["lm_head"]})}
    classes = engine_fingerprint(config(model_class_overrides={"LlamaForCausalLM": "x:Y"}))
    code = engine_fingerprint(config(trust_remote_code=True))
    (ckpt / "modeling_tiny.py").write_text("SCALE = 2.0\n")
    code2 = engine_fingerprint(config(trust_remote_code=True))
    assert len({plain, *uris, *quants, classes, code, code2}) == 8
    assert engine_fingerprint(config()) == plain   # code counts with trust_remote_code only


def test_a_model_id_the_daemon_would_refuse_is_refused_at_start() -> None:
    """Over 1024 characters with its namespace and weights mark, or not valid Unicode:
    every lookup and save was a refused round trip (found by review)."""
    assert len(model_id(model_id="m" * 1000, model_fingerprint="off")) == 1000
    with pytest.raises(ConfigError, match=r"1040 characters.*at most 1024"):
        model_id(model_id="m" * 1000, namespace="p" * 39, model_fingerprint="off")
    with pytest.raises(ConfigError, match="at most 1024"):
        model_id(model_id="m" * 1015)            # the weights mark makes it too long
    with pytest.raises(ConfigError, match="not valid Unicode"):
        model_id(model_id="m\ud800", model_fingerprint="off")


def test_a_function_given_as_hf_overrides_counts_by_what_it_does(tmp_path: Any) -> None:
    """Two engines whose ``hf_overrides`` were inner functions of one factory (one name)
    but changed the model differently shared KV and gave wrong tokens (review repro:
    ``rms_norm_eps`` 0.5 against 1e-6): the function's code and the values it closes over
    count. The config it made does not: vLLM's model loading changes the workers' copy
    (an EAGLE draft sets ``target_layer_count``), not the scheduler's, and a digest of it
    split one engine into two namespaces (found by review)."""
    import functools
    from types import SimpleNamespace

    from kvtier.connectors.vllm.fingerprint import engine_fingerprint
    from kvtier.connectors.vllm.overrides import _plain, callable_digest
    from transformers import LlamaConfig

    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"w" * 4096)

    def factory(eps: float, marker: object = None) -> Any:
        def override(cfg: Any) -> Any:
            cfg.rms_norm_eps = eps
            cfg.marker = marker
            return cfg
        return override

    def engine(fn: Any) -> Any:
        return SimpleNamespace(model=str(ckpt), revision=None, dtype="float32",
                               quantization=None, hf_overrides=fn,
                               hf_config=fn(LlamaConfig(hidden_size=64)),
                               hf_config_path=None, hf_text_config=None, max_model_len=64)

    a, b = engine(factory(0.5)), engine(factory(1e-6))
    assert a.hf_overrides.__qualname__ == b.hf_overrides.__qualname__
    assert engine_fingerprint(a) != engine_fingerprint(b)
    assert engine_fingerprint(a) == engine_fingerprint(engine(factory(0.5)))
    # the worker's copy of the config, changed as vLLM loads the model: the same key
    before = engine_fingerprint(a)
    a.hf_config.target_layer_count = 6
    assert engine_fingerprint(a) == before
    # values without a stable text: no address (each process has its own), sets sorted
    assert callable_digest(factory(0.5, object())) == callable_digest(factory(0.5, object()))
    assert _plain({"b", "a", "c"}, 0) == ["a", "b", "c"]
    assert _plain({3: 1, "k": 2}, 0) == {"3": 1, "k": 2}
    part = functools.partial(factory, 0.5)
    assert callable_digest(part) != callable_digest(functools.partial(factory, 0.25))



EPS_SOURCE = """
import math

SETTINGS = {"rms_norm_eps": EPS}

def helper(cfg):
    cfg.rope_theta = THETA
    return cfg

def override(cfg):
    cfg.rms_norm_eps = EPS
    cfg.update(SETTINGS)
    cfg.scale = math.sqrt(2.0)
    return helper(cfg)
"""


def _override_in_module(**values: Any) -> Any:
    """``override`` of a module whose module-level values are ``values``."""
    space: dict[str, Any] = {"__name__": "user_overrides", **values}
    exec(compile(EPS_SOURCE, "user_overrides.py", "exec"), space)
    return space["override"]


def test_module_level_values_an_override_reads_count_too() -> None:
    """An override that reads a module-level value (``EPS = float(os.environ[...])``) and
    two engines that set it differently: one name, one code, other KV. The value counts,
    and so does a value a function of the same module reads; a module counts by its name
    (not walked), and a value read nowhere does not count."""
    from kvtier.connectors.vllm.overrides import callable_digest

    base = callable_digest(_override_in_module(EPS=0.5, THETA=1e4))
    assert base == callable_digest(_override_in_module(EPS=0.5, THETA=1e4))
    assert base != callable_digest(_override_in_module(EPS=1e-6, THETA=1e4))
    assert base != callable_digest(_override_in_module(EPS=0.5, THETA=5e5))   # in helper
    assert base == callable_digest(_override_in_module(EPS=0.5, THETA=1e4, UNUSED=3))
    fn = _override_in_module(EPS=0.5, THETA=1e4)
    fn.__globals__["SETTINGS"]["rms_norm_eps"] = 0.25    # a dict it reads, changed
    assert callable_digest(fn) != base


def test_an_override_that_calls_itself_or_library_code_has_a_bounded_digest() -> None:
    """Functions of other modules count by their module and name, and a function that
    names itself is not followed again: the digest stays small and fast."""
    import json

    from kvtier.connectors.vllm.overrides import _describe, callable_digest

    space: dict[str, Any] = {"__name__": "user_overrides", "json": json}
    exec("from json import dumps\n"
         "def override(cfg, n=3):\n"
         "    return override(cfg, n - 1) if n else dumps(cfg)\n", space)
    found = _describe(space["override"], 0)["globals"]
    assert found == {"dumps": "json.dumps"}
    assert _describe(_override_in_module(EPS=0.5, THETA=1e4), 0)["globals"]["math"] == "math"
    assert len(callable_digest(space["override"])) == 32
