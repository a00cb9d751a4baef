"""`kvagent-server deploy` and the tiers in deployment files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import NO_PLUGIN, config
from kvagent_server.cli.app import app
from kvagent_server.config import ConfigError
from kvagent_server.deploy import DeployOptions, render_compose, render_kubernetes
from typer.testing import CliRunner


def write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_kubernetes(tmp_path: Path) -> None:
    cfg = write(tmp_path, "b.yaml", {"model": "org/m", "prefill": {"count": 2}})
    opts = write(tmp_path, "o.yaml", {"namespace": "agents", "router_replicas": 3})
    result = CliRunner().invoke(app, ["deploy", "--target", "kubernetes", "-c", str(cfg),
                                      "--options", str(opts), "--image", "reg/kv:1"])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    assert sts["metadata"]["namespace"] == "agents"
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/kv:1"
    router = next(d for d in docs if d["kind"] == "Deployment"
                  and d["metadata"]["name"] == "kvagent-router")
    assert router["spec"]["replicas"] == 3


def test_cli_compose(tmp_path: Path) -> None:
    cfg = write(tmp_path, "b.yaml", {"model": "/models/m", "decode": {"count": 2}})
    result = CliRunner().invoke(app, ["deploy", "-t", "compose", "-c", str(cfg),
                                      "--gpus", "3"])
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout)
    assert list(doc["services"]) == ["prefill-0", "decode-0", "decode-1", "router"]


@pytest.mark.parametrize(("args", "msg"), [
    (["--target", "helm", "--model", "org/m"], "is not one of kubernetes, compose"),
    (["--target", "kubernetes", "--model", "org/m", "--rdma", "roce"], "deploy options: rdma"),
    (["--target", "kubernetes"], "model: required for deploy"),
])
def test_cli_errors(args: list[str], msg: str) -> None:
    result = CliRunner().invoke(app, ["deploy", *args])
    assert result.exit_code == 2
    assert msg in " ".join(result.output.split())


def tier_config(tmp_path: Path, shared: bool) -> Any:
    return config(kv_tiers={"cpu": {"size_gib": 4},
                            "disk": {"path": str(tmp_path / "kv"), "shared": shared}})


def test_kubernetes_mounts_the_tier(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tier_volume_claim"):
        render_kubernetes(tier_config(tmp_path, True), plugin=NO_PLUGIN)
    text = render_kubernetes(tier_config(tmp_path, True),
                             DeployOptions(tier_volume_claim="kv-rwx"), plugin=NO_PLUGIN)
    sts = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert {"name": "kv-tier", "persistentVolumeClaim": {"claimName": "kv-rwx"}} in pod[
        "volumes"]
    c = pod["containers"][0]
    assert {"name": "kv-tier", "mountPath": str(tmp_path / "kv")} in c["volumeMounts"]
    assert "MultiConnector" in c["args"][c["args"].index("--kv-transfer-config") + 1]
    private = render_kubernetes(tier_config(tmp_path, False), plugin=NO_PLUGIN)
    sts = next(d for d in yaml.safe_load_all(private) if d and d["kind"] == "StatefulSet")
    assert {"name": "kv-tier", "emptyDir": {}} in sts["spec"]["template"]["spec"]["volumes"]


def test_compose_binds_the_tier(tmp_path: Path) -> None:
    cfg = tier_config(tmp_path, False)
    doc = yaml.safe_load(render_compose(cfg, DeployOptions(gpus=2), plugin=NO_PLUGIN))
    kv = str(tmp_path / "kv")
    assert f"{kv}:{kv}" in doc["services"]["prefill-0"]["volumes"]


def test_tiers_on_cpu_deploy_with_kvagents_spec(tmp_path: Path) -> None:
    cfg = config(device="cpu", kv_tiers={"cpu": {"size_gib": 4}})
    assert "KvagentTieringSpec" in render_kubernetes(cfg, plugin=NO_PLUGIN)
    lmcache = config(device="cpu", kv_tiers={"backend": "lmcache", "cpu": {"size_gib": 4}})
    with pytest.raises(ConfigError, match="needs device=cuda"):
        render_kubernetes(lmcache, plugin=NO_PLUGIN)
