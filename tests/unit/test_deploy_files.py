"""deploy/: Kubernetes manifests against the Kubernetes schemas (offline), configs that load,
the pieces that must agree with each other, and generated files that are current.

The systemd unit (systemd-analyze verify) and the Containerfile's install (a wheel built
from exactly what it copies) run tools, so they live in tests/integration/test_deploy_tools.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # no type hints (no py.typed)
import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from kvtier import __version__
from kvtier.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p.name}:{d['kind']}", d) for p in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]


def by_kind(kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for _, d in k8s_docs()
                if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation must not download schemas: any socket is an error."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("schema validation tried to open a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("name,doc", k8s_docs(), ids=[n for n, _ in k8s_docs()])
def test_manifest_matches_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.usefixtures("no_network")
def test_the_validator_rejects_a_misspelt_field() -> None:
    ds = by_kind("DaemonSet")
    bad = json.loads(json.dumps(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_expected_manifests_exist() -> None:
    kinds = {d["kind"] for _, d in k8s_docs()}
    assert {"DaemonSet", "Deployment", "ConfigMap", "StatefulSet", "Service"} <= kinds


def test_configs_load(tmp_path: Path) -> None:
    cfg = load_config(DEPLOY / "kvtier.toml")
    assert cfg.nvme.write_budget_bytes_per_s == 500_000_000
    toml = by_kind("ConfigMap", "kvtier-config")["data"]["kvtier.toml"]
    (tmp_path / "k.toml").write_text(toml)
    k = load_config(tmp_path / "k.toml")
    assert str(k.daemon.socket) == "/run/kvtier/kvtier.sock" and k.http.port == 8470


def test_engine_and_daemon_share_socket_shm_and_uid() -> None:
    ds = by_kind("DaemonSet")["spec"]["template"]["spec"]
    vllm = by_kind("Deployment")["spec"]["template"]["spec"]

    def host_paths(spec: dict[str, Any]) -> dict[str, str]:
        vols = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        return {m["mountPath"]: vols[m["name"]] for m in spec["containers"][0]["volumeMounts"]
                if m["name"] in vols}

    d, e = host_paths(ds), host_paths(vllm)
    assert d["/dev/shm"] == e["/dev/shm"] == "/dev/shm"
    assert d["/run/kvtier"] == e["/run/kvtier"]
    assert ds["securityContext"]["runAsUser"] == vllm["securityContext"]["runAsUser"]
    arg = next(a for a in vllm["containers"][0]["args"] if a.startswith("--kv-transfer-config"))
    conf = json.loads(arg.split("=", 1)[1])
    assert conf["kv_connector"] == "KVTierConnector"
    assert conf["kv_connector_extra_config"]["socket_path"] == "/run/kvtier/kvtier.sock"
    port = ds["containers"][0]["ports"][0]["containerPort"]
    assert by_kind("DaemonSet")["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"] == str(port)


def test_daemonset_is_hardened_and_its_image_is_the_containerfile() -> None:
    spec = by_kind("DaemonSet")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in spec["containers"] + spec["initContainers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert c["image"] == f"kvtier:{__version__}"
    text = (DEPLOY / "Containerfile").read_text()
    assert re.search(r"^USER 1000:1000$", text, re.M)
    assert 'ENTRYPOINT ["kvtier"]' in text
    assert f"-t kvtier:{__version__}" in text


def test_systemd_unit_has_the_hardening() -> None:
    text = (DEPLOY / "systemd" / "kvtier.service").read_text()
    keys = dict(line.split("=", 1) for line in text.splitlines()
                if "=" in line and not line.startswith("#"))
    for key, value in {"RuntimeDirectory": "kvtier", "StateDirectory": "kvtier",
                       "ProtectSystem": "strict", "PrivateTmp": "yes",
                       "NoNewPrivileges": "yes", "LimitMEMLOCK": "infinity",
                       "RemoveIPC": "no", "RuntimeDirectoryMode": "0700"}.items():
        assert keys.get(key) == value, key
    assert "/run/kvtier/kvtier.sock" in keys["Environment"] or \
        "KVTIER_SOCKET=/run/kvtier/kvtier.sock" in text


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_dashboard_is_generated_and_well_formed() -> None:
    gen = _load(DEPLOY / "grafana" / "gen_dashboard.py")
    text = (DEPLOY / "grafana" / "kvtier.json").read_text()
    assert gen.build() == text, "kvtier.json is stale: run python deploy/grafana/gen_dashboard.py"
    dash = json.loads(text)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert len(rows) == 2
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] for t in p["targets"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for needle in ("kvtier_bytes_moved_total", "kvtier_op_seconds_bucket",
                   "kvtier_prefetch_total", "kvtier_checksum_failures_total",
                   "kvtier_evictions_total", "vllm:num_preemptions_total",
                   "vllm:request_prompt_tokens_bucket", "vllm:num_requests_waiting"):
        assert needle in exprs
