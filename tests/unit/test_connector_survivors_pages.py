"""What the scheduler side knows of its pages and of the cost of a load: stale reports,
unconfirmed loads and their bounds (outcomes.py), bad pages through partial rewrites
(badpages.py), the reload-versus-recompute rule at its edges (recompute.py), a load span
of a local hit off a page boundary (mapping.py), and what makes a request or an engine
another namespace (salts.py, fingerprint.py). Each was found unpinned by a mutation review
of the connector: a test fails on its mutant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector package imports vLLM")

from kvtier.connectors.vllm.badpages import BadPages
from kvtier.connectors.vllm.fingerprint import engine_fingerprint
from kvtier.connectors.vllm.mapping import PageMap
from kvtier.connectors.vllm.metadata import KVTierConnectorMetadata, TransferSpec
from kvtier.connectors.vllm.outcomes import PageOutcomes
from kvtier.connectors.vllm.pieces import FAILED_STEPS_KEPT
from kvtier.connectors.vllm.recompute import PREFILL_ALPHA, RecomputeModel
from kvtier.connectors.vllm.salts import request_salt

from tests.support.vllm_fakes import fake as NS

PAGE, PPB = 32, 2


def _meta(step: int, *loads: tuple[list[list[int]], int]) -> KVTierConnectorMetadata:
    meta = KVTierConnectorMetadata(step=step)
    for pages, skip in loads:
        tokens = np.arange(1, len(pages) * PAGE * PPB + 1, dtype=np.uint32)
        meta.loads.append(TransferSpec("A", None, tokens, 0, pages, skip))
    return meta


def test_a_page_reported_stale_long_ago_fails_again() -> None:
    """Page 12 was named stale once; more than FAILED_STEPS_KEPT steps later a load into it
    fails. That failure is news (kept as an echo of the old report forever, it was
    dropped: the page counted sound and a sharer decoded on it)."""
    out = PageOutcomes(PAGE, PPB)
    out.bad.failed([12, 13], {12})
    out.report_stale(_meta(0), [(NS(page_ids=[12, 13]), 2 * PAGE)])
    assert out.failures({12}) == set()      # the workers' echo of the report
    for step in range(1, FAILED_STEPS_KEPT + 1):
        out.report_stale(_meta(step), [])
    assert out.failures({12}) == {12}


def test_no_stale_report_under_async_scheduling() -> None:
    """With stale reports off (vLLM's async scheduling: a rollback it did not start itself
    crashed the engine), a request relying on a bad page is not named."""
    out = PageOutcomes(PAGE, PPB)
    out.bad.failed([12, 13], {12})
    out.stale_reports = False
    meta = _meta(0)
    out.report_stale(meta, [(NS(page_ids=[12, 13]), 2 * PAGE)])
    assert meta.stale_pages == []


def test_a_load_s_kept_local_pages_are_not_confirmed_loaded() -> None:
    """A load keeps its first page (vLLM computed it; skip_pages=1) and fills the second.
    Confirmed, only the filled page counts loaded: the kept page, bad, stays bad (taken as
    loaded, a bad page was sound again and saved)."""
    out = PageOutcomes(PAGE, PPB)
    out.bad.failed([10, 11], {10})
    out.loads_planned(_meta(3, ([[10, 11]], 1)))
    assert out.confirmed(3) == {11}


def test_unconfirmed_loads_are_kept_a_bounded_number_of_steps() -> None:
    """Loads of steps whose output never came (no worker metadata) are forgotten after
    FAILED_STEPS_KEPT steps: confirmed late, the oldest would count pages loaded that may
    have been failed and reused since."""
    out = PageOutcomes(PAGE, PPB)
    n = FAILED_STEPS_KEPT + 2
    for step in range(n):
        out.loads_planned(_meta(step, ([[100 + step, 200 + step]], 0)))
    assert out.confirmed(n) == {p for s in range(2, n) for p in (100 + s, 200 + s)}


def test_a_rewrite_on_a_page_still_bad_does_not_clear_the_next() -> None:
    """A step computes tokens 16..63 into pages 10 and 11, both bad: page 10 is rewritten
    only from its 16th token (its head stays bad), so page 11, computed on it, is no better
    and stays bad (cleared, it was saved with KV computed on another prompt's head)."""
    bad = BadPages(PAGE)
    bad.failed([10, 11], {10})
    bad.rewritten([10, 11], 16, 64)
    assert bad.pages == {10, 11}


def test_a_page_failed_again_is_rewritten_from_its_start() -> None:
    """Page 10 was rewritten up to token 16 when a load into it failed again: its earlier
    progress is void, so continuing from 16 to its end does not make it sound."""
    bad = BadPages(PAGE)
    bad.failed([10], {10})
    bad.rewritten([10], 0, 16)
    bad.failed([10], {10})
    bad.rewritten([10], 16, 32)
    assert bad.pages == {10}
    bad.rewritten([10], 0, 32)
    assert bad.pages == set()


def test_a_reload_as_fast_as_recompute_is_loaded() -> None:
    """Reloading a block takes exactly as long as recomputing it: it is loaded (only a
    block slower to reload than to recompute is skipped)."""
    model = RecomputeModel(tokens_per_block=64, block_bytes=1000, prefill_tokens_per_s=64.0,
                           tier_bandwidth={"redis": 1000.0})
    assert model.worth_loading(["redis"] * 3, {}, 0, 3) == 3
    slower = RecomputeModel(tokens_per_block=64, block_bytes=1001, prefill_tokens_per_s=64.0,
                            tier_bandwidth={"redis": 1000.0})
    assert slower.worth_loading(["redis"] * 3, {}, 0, 3) == 0


def test_prefill_is_measured_from_one_block_steps_on_and_smoothed() -> None:
    """A step of exactly one block is a prefill measure; a later one moves the estimate by
    PREFILL_ALPHA of the difference (the newest sample weighs PREFILL_ALPHA)."""
    model = RecomputeModel(tokens_per_block=64, block_bytes=1000, prefill_tokens_per_s=1.0,
                           warmup_steps=0)
    model.observe_step(64, 1.0)
    assert model.measured_steps == 1 and model.prefill_tokens_per_s == 64.0
    model.observe_step(128, 0.5)
    assert model.prefill_tokens_per_s == pytest.approx(
        PREFILL_ALPHA * 256.0 + (1 - PREFILL_ALPHA) * 64.0)


def test_a_local_hit_off_a_page_boundary_loads_nothing() -> None:
    """vLLM's local hit ends mid-page (48 tokens of 32-token pages): no load is planned
    (a load from page 1 on would overwrite the 16 tokens of it vLLM computed)."""
    assert PageMap(PAGE, PAGE * PPB).load_span(48, 3, 4 * PAGE * PPB) is None
    assert PageMap(PAGE, PAGE * PPB).load_span(32, 3, 4 * PAGE * PPB) is not None


@pytest.mark.parametrize("field", ["mm_features", "prompt_embeds"])
def test_a_request_not_made_of_token_ids_alone_has_no_salt(field: str) -> None:
    """Multimodal inputs or prompt embeddings: its KV is not a function of its token ids,
    so it is never cached (False), whichever of the two it has."""
    fields: dict[str, Any] = dict(cache_salt=None, lora_request=None, mm_features=None,
                                  prompt_embeds=None)
    fields[field] = [1.0]
    assert request_salt(NS(**fields)) is False
    fields[field] = None
    assert request_salt(NS(**fields)) is None


def _model(ckpt: Path, **kw: Any) -> Any:
    base: dict[str, Any] = dict(model=str(ckpt), revision=None, dtype="float32",
                                quantization=None, hf_overrides={}, max_model_len=4096,
                                hf_config_path=None, hf_text_config=None)
    return NS(**{**base, **kw})


def test_quantization_and_an_undecidable_longrope_count(tmp_path: Path) -> None:
    """The same checkpoint quantized on load (awq) computes other KV: another fingerprint.
    A LongRoPE model whose lengths cannot be read is never the namespace of the same
    checkpoint without the rope setting, nor of its short factors or its long ones."""
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"w" * 4096)
    plain = engine_fingerprint(_model(ckpt))
    assert engine_fingerprint(_model(ckpt, quantization="awq")) != plain
    rope = NS(rope_parameters={"rope_type": "longrope", "short_factor": [1.0],
                               "long_factor": [4.0]})
    short = NS(rope_parameters={"rope_type": "longrope", "short_factor": [1.0],
                                "long_factor": [4.0], "original_max_position_embeddings": 8192})
    unknown = engine_fingerprint(_model(ckpt, hf_text_config=rope))
    assert unknown != plain
    assert unknown != engine_fingerprint(_model(ckpt, hf_text_config=short))
    long = NS(rope_parameters={"rope_type": "longrope", "short_factor": [1.0],
                               "long_factor": [4.0], "original_max_position_embeddings": 1024})
    assert unknown != engine_fingerprint(_model(ckpt, hf_text_config=long))
