"""What docs/operations.md ("Deploying") and the systemd unit say about the socket and data
directory variables holds: env beats the TOML, and the short names win over the long ones
in the daemon's config and in a client's default socket alike."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import default_socket_path, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_env_beats_the_toml_and_the_short_names_win(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text(f'[daemon]\nsocket = "{tmp_path}/toml.sock"\n'
                    f'data_dir = "{tmp_path}/toml-data"\n')
    env = {"KVTIER_SOCKET": f"{tmp_path}/short.sock",
           "KVTIER_DAEMON_SOCKET": f"{tmp_path}/long.sock",
           "KVTIER_DATA_DIR": f"{tmp_path}/short-data",
           "KVTIER_DAEMON_DATA_DIR": f"{tmp_path}/long-data"}
    cfg = load_config(toml, env=env)
    assert cfg.daemon.socket == tmp_path / "short.sock"
    assert cfg.daemon.data_dir == tmp_path / "short-data"
    assert default_socket_path(env) == tmp_path / "short.sock"
    assert load_config(toml, env={}).daemon.socket == tmp_path / "toml.sock"
    only_long = {"KVTIER_DAEMON_SOCKET": f"{tmp_path}/long.sock"}
    assert load_config(toml, env=only_long).daemon.socket == tmp_path / "long.sock"
    assert default_socket_path(only_long) == tmp_path / "long.sock"


def test_the_unit_says_its_environment_overrides_the_toml() -> None:
    unit = (ROOT / "deploy" / "systemd" / "kvtier.service").read_text()
    ops = " ".join((ROOT / "docs" / "operations.md").read_text().split())
    assert "Environment=KVTIER_SOCKET=" in unit and "Environment=KVTIER_DATA_DIR=" in unit
    assert "override daemon.socket and daemon.data_dir" in unit
    assert "KVTIER_SOCKET wins over KVTIER_DAEMON_SOCKET" in unit
    assert "When both `KVTIER_SOCKET` and `KVTIER_DAEMON_SOCKET` are set, `KVTIER_SOCKET` wins" \
        in ops
