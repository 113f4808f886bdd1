"""Relative paths in the config tree become absolute where they are read: a TOML file's from
the file's directory, env's and flags' from the working directory. Left relative, the daemon
(under systemd its working directory is ``/``) and a client started elsewhere would look in
two places, and logs and ``kvtier stats`` would name paths no reader can place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError


def test_a_files_relative_paths_are_taken_from_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From another working directory, the file's ``state`` is still beside the file."""
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "kvtier.toml").write_text(
        '[daemon]\ndata_dir = "state"\n[cpu]\nshm_dir = "../shm"\n[nvme]\npath = "nv"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(Path("../etc/kvtier.toml"), env={})
    assert cfg.daemon.data_dir == elsewhere / "../etc/state"
    assert cfg.daemon.data_dir.resolve() == conf / "state"
    assert cfg.cpu.shm_dir.resolve() == tmp_path / "shm"     # '..' kept, not normalized
    assert cfg.nvme.path == elsewhere / "../etc/nv"
    assert cfg.nvme_path.is_absolute()


def test_env_and_flag_paths_are_taken_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, env={"KVTIER_SOCKET": "run/k.sock", "KVTIER_DATA_DIR": "d"},
                      overrides={"nvme.path": "n"})
    assert cfg.daemon.socket == tmp_path / "run/k.sock"
    assert cfg.daemon.data_dir == tmp_path / "d"
    assert cfg.nvme.path == tmp_path / "n"


def test_absolute_and_home_paths_are_left_as_given(tmp_path: Path) -> None:
    cfg = load_config(None, env={"KVTIER_DATA_DIR": "~/kv", "KVTIER_SOCKET": str(tmp_path)})
    assert cfg.daemon.data_dir == Path.home() / "kv"
    assert cfg.daemon.socket == tmp_path


def test_a_file_value_overridden_by_env_is_placed_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The anchor goes with the source that won, not with the file that lost."""
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "kvtier.toml").write_text('[daemon]\ndata_dir = "state"\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(conf / "kvtier.toml", env={"KVTIER_DATA_DIR": "mine"})
    assert cfg.daemon.data_dir == tmp_path / "mine"


def test_a_relative_path_with_no_working_directory_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    os.rmdir(gone)
    with pytest.raises(ConfigError, match=r"env KVTIER_DATA_DIR: relative path d cannot be "
                                          r"placed .*give an absolute path"):
        load_config(None, env={"KVTIER_DATA_DIR": "d"})
