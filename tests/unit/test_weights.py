"""The weights fingerprint (kvtier.weights): the same checkpoint anywhere gives the same
fingerprint, other weights or KV-changing settings another, and reading it costs a few
windows per file, not the checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.weights import WINDOW_BYTES, WINDOWS, base_model_id, checkpoint_files, fingerprint


def checkpoint(root: Path, seed: int = 0, size: int = 3 << 20) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    (root / "model-00001-of-00002.safetensors").write_bytes(data[: size // 2].tobytes())
    (root / "model-00002-of-00002.safetensors").write_bytes(data[size // 2:].tobytes())
    (root / "tokenizer.json").write_text("{}")          # not weights: not read
    return root


def test_copies_agree_and_changes_are_seen(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a")
    fp = fingerprint(str(a), dtype="torch.bfloat16")
    assert len(fp) == 16 and int(fp, 16) >= 0
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, copy)                             # another node, another path
    assert fingerprint(str(copy), dtype="bfloat16") == fp
    (copy / "tokenizer.json").write_text('{"x": 1}')
    assert fingerprint(str(copy), dtype="bfloat16") == fp
    assert [p.name for p in checkpoint_files(str(a)) or []] == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # another seed of the same architecture and sizes, another dtype, quantization or
    # override: another fingerprint
    other = checkpoint(tmp_path / "c", seed=1)
    assert fingerprint(str(other), dtype="bfloat16") != fp
    assert fingerprint(str(a), dtype="float16") != fp
    assert fingerprint(str(a), dtype="bfloat16", quantization="fp8") != fp
    assert fingerprint(str(a), dtype="bfloat16", overrides={"rope_theta": 1e6}) != fp


def test_a_mistral_format_params_json_counts(tmp_path: Path) -> None:
    """A Mistral-format checkpoint (``consolidated.safetensors`` and ``params.json``, run with
    ``config_format="mistral"``) has its sizes and rope_theta in ``params.json``: changed in
    place, the same weights compute other KV, which a fresh engine loaded (found by review:
    wrong tokens)."""
    m = tmp_path / "mistral"
    m.mkdir()
    (m / "params.json").write_text('{"dim": 64, "rope_theta": 10000.0}')
    (m / "consolidated.safetensors").write_bytes(bytes(range(256)) * 64)
    before = fingerprint(str(m), dtype="float32")
    assert [p.name for p in checkpoint_files(str(m)) or []] == [
        "params.json", "consolidated.safetensors"]
    (m / "params.json").write_text('{"dim": 64, "rope_theta": 500000.0}')
    assert fingerprint(str(m), dtype="float32") != before


@pytest.mark.parametrize("window", range(WINDOWS))
def test_a_change_in_any_window_is_seen(tmp_path: Path, window: int) -> None:
    a = checkpoint(tmp_path / "a")
    before = fingerprint(str(a))
    shard = a / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    pos = window * ((size - WINDOW_BYTES) // (WINDOWS - 1)) + 100
    with shard.open("r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert fingerprint(str(a)) != before


def test_a_single_file_and_an_unknown_name(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    assert checkpoint_files(str(gguf)) == [gguf]
    assert fingerprint(str(gguf)) != fingerprint(str(tmp_path / "missing.gguf"))
    # a hub name with nothing cached: name and revision only
    assert checkpoint_files("no-such-org/no-such-model") is None   # not a local path
    assert fingerprint("no-such-org/no-such-model", revision="v1") != \
        fingerprint("no-such-org/no-such-model", revision="v2")


def test_base_model_id() -> None:
    assert base_model_id("org/m#w=0011223344556677") == "org/m"
    assert base_model_id("org/m") == "org/m"


def test_an_unreadable_file_does_not_fail_the_start(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    a = checkpoint(tmp_path / "a")
    fine = fingerprint(str(a))
    real_open = Path.open

    def refuse(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name.startswith("model-00002"):
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    unreadable = fingerprint(str(a))
    assert len(unreadable) == 16 and unreadable != fine


def test_a_hub_name_is_named_by_its_cached_commit(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub name fingerprints the same however much of its snapshot is downloaded (a
    process may read it while another fills the cache), and differs when the cache's
    snapshot moves to another commit."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--model"

    def snapshot(commit: str) -> Path:
        d = repo / "snapshots" / commit
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        return d

    first = snapshot("a" * 40)
    before = fingerprint("org/model")
    (first / "model.safetensors").write_bytes(b"w" * 4096)      # the weights arrive
    assert fingerprint("org/model") == before
    snapshot("b" * 40)                                           # a new commit
    assert fingerprint("org/model") != before
    assert fingerprint("org/model", revision="a" * 40) == before


def _safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def test_a_change_to_one_tensor_is_seen_wherever_it_lies(tmp_path: Path) -> None:
    """A merged LoRA or a partly unfrozen fine-tune changes a few tensors: the file keeps
    its size and header, and eight windows per file missed most tensors of a small model
    (29 of 39; found by review). Every tensor now has windows of its own."""
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.v_proj.weight": rng.standard_normal((128, 128)).astype(np.float32)
               for i in range(40)}   # 64 KiB each, 2.5 MiB in all
    a = tmp_path / "a"
    _safetensors(a / "model.safetensors", tensors)
    (a / "config.json").write_text('{"model_type": "llama"}')
    before = fingerprint(str(a))
    size = (a / "model.safetensors").stat().st_size
    step = (size - WINDOW_BYTES) // (WINDOWS - 1)
    header = 8 + int.from_bytes((a / "model.safetensors").read_bytes()[:8], "little")
    meta = json.loads((a / "model.safetensors").read_bytes()[8:header])
    unseen = [name for name, t in meta.items() if name != "__metadata__" and not any(
        header + t["data_offsets"][0] < i * step + WINDOW_BYTES and
        i * step < header + t["data_offsets"][1] for i in range(WINDOWS))]
    assert unseen   # tensors the file windows alone never read
    for name in unseen[:3]:
        changed = dict(tensors)
        changed[name] = tensors[name] + np.float32(0.01)   # a dense update, same shape
        b = tmp_path / name
        _safetensors(b / "model.safetensors", changed)
        (b / "config.json").write_text('{"model_type": "llama"}')
        assert (b / "model.safetensors").stat().st_size == size
        assert fingerprint(str(b)) != before, name
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert fingerprint(str(copy)) == before
