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

    from kvtier.connectors.vllm.config import engine_fingerprint

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
