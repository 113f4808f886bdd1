"""The model id the connector registers: vLLM's model name (or ``model_id``), prefixed by
``namespace``, with the weights fingerprint appended (``model_fingerprint``)."""

from __future__ import annotations

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
